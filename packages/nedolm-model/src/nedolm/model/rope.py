"""Rotary position embeddings indexed by explicit position ids.

Packed rows restart positions at every segment, so the table is gathered per token instead of
sliced by offset. Uses the half-rotation layout of Hugging Face Llama so exported weights need
no permutation.
"""

# Shape legend: T tokens, H heads, K head dim.
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def rope_table(
    head_dim: int, max_seq_len: int, theta: float, scaling: dict[str, Any] | None = None
) -> tuple[Tensor, Tensor]:
    """cos/sin tables [max_seq_len, head_dim] in float32; `scaling` is a llama3 rope_scaling.

    Computed on the CPU whatever the default device: a model built on a GPU gets the same bits
    as one built on the host and moved there (float64 cos/sin may round differently on a GPU).
    """
    steps = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu")
    inv_freq = 1.0 / (theta ** (steps / head_dim))
    if scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device="cpu"), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x_THK: Tensor, cos_TK: Tensor, sin_TK: Tensor) -> Tensor:
    """Rotate each head of x by its token's angle (math in float32, result in x's dtype)."""
    x = x_THK.float()
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    out = x * cos_TK[:, None, :] + rotated * sin_TK[:, None, :]
    return out.to(x_THK.dtype)


def llama3_inv_freq(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    """Llama 3.1 frequency scaling, the formula of transformers' `_compute_llama3_parameters`.

    Wavelengths shorter than original_context / high_freq_factor are kept, those longer than
    original_context / low_freq_factor are divided by `factor`, and the band between is
    interpolated smoothly.
    """
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(is_medium, smoothed, scaled)
