"""Model FLOPs per trained token and the accelerator's peak: the two halves of MFU.

The one FLOP count of the project: the run's ``mfu`` and every bench (``bench/model_gpu.py``,
``bench/trainer_gpu.py``) use ``flops_per_token``, so their MFU figures compare. Convention
(nanoGPT/nanochat's and torchtitan's, so figures compare with theirs too):

    flops_per_token = 6 * N + 12 * n_layers * n_heads * head_dim * seq_len

* ``N`` (``matmul_params_per_token``) is every weight a token multiplies through: the attention
  and SwiGLU projections of every block, the one morph expert of the token's class (the work
  ``sparse`` dispatch does), and the output head over the logical vocabulary. The input
  embedding is a lookup, not a matmul, and is left out (tied or not); so are norms.
* 6 = 2 (multiply-add) x 3 (forward, and backward for activations and for weights).
* The attention term counts QK^T and PV, forward and backward, for the *full row* of
  ``seq_len`` keys: not halved for causality and not reduced for packing (short packed
  conversations attend to far fewer keys), as the convention is.
* The loss head counts every token, though the fused head computes only the targets.

It is a figure of the model, not of our shortcuts: skipping work (targets-only head, per-
conversation attention) shows as higher tokens/s, never as a larger FLOP count.
"""

from __future__ import annotations

import re

from nedolm.model import ModelConfig

# Dense bf16 tensor-core peaks (FLOP/s, no sparsity; NVIDIA's datasheets) by a model name in the
# CUDA device name ("A10" is not found in "A100", nor "L4" in "L40"). The first key found wins, so
# a key comes before every key it contains ("H100 NVL" before "H100").
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H800 PCIe", 756e12),
    ("H800", 989e12),
    ("GB200", 2500e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
)


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights one token multiplies through: every block's projections, its class's morph
    expert, and the output head over the vocabulary (padding rows are never computed)."""
    head_dim = cfg.head_dim
    attention = cfg.d_model * (cfg.n_heads + 2 * cfg.n_kv_heads) * head_dim
    attention += cfg.n_heads * head_dim * cfg.d_model
    feed_forward = 3 * cfg.d_model * cfg.ffn_dim
    expert = 3 * cfg.d_model * cfg.morph_expert_dim if cfg.n_morph_classes else 0
    return cfg.n_layers * (attention + feed_forward + expert) + cfg.d_model * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token of a ``seq_len`` row."""
    attention_scores = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    return 6.0 * matmul_params_per_token(cfg) + attention_scores


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a CUDA device by its name, or None when the table lacks it."""
    return next(
        (peak for key, peak in PEAK_BF16_FLOPS if re.search(rf"\b{re.escape(key)}\b", device_name)),
        None,
    )
