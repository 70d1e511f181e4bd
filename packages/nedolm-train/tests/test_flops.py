"""MFU's numerator: the formula's FLOPs per token equal what torch counts in a real step."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from nedolm.model import ModelConfig, build_model
from nedolm.train.flops import PEAK_BF16_FLOPS, flops_per_token, peak_bf16_flops


@pytest.mark.parametrize("morph_classes", [0, 3])
def test_flops_per_token_equal_torch_flop_counter(morph_classes: int) -> None:
    """Forward + backward of one full row; sparse dispatch runs each token's expert once, and
    the math SDPA backend is counted as the full score matrix, as the formula assumes."""
    cfg = ModelConfig(
        vocab_size=203,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=96,
        n_morph_classes=morph_classes,
        morph_expert_dim=16 if morph_classes else 0,
        morph_dispatch="sparse",
        max_seq_len=128,
        attn_impl="sdpa",
    )
    torch.manual_seed(0)
    model = build_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 128))
    model(ids, ids)  # the attention backend's start-up probe runs once, here, uncounted
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss, _ = model(ids, ids)
        loss.backward()
    assert counter.get_total_flops() == flops_per_token(cfg, 128) * 128


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA L40", 181e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA GB200", 2500e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA RTX A1000", None),  # not an A10
        ("Some Future Accelerator", None),
    ],
)
def test_peak_by_device_name(name: str, peak: float | None) -> None:
    assert peak_bf16_flops(name) == peak


def test_no_key_of_the_peak_table_is_shadowed_by_an_earlier_one() -> None:
    """The first key found in the name wins: an earlier one found in a later key's device name
    ("H100" in "H100 NVL") would give that device the wrong peak."""
    for key, peak in PEAK_BF16_FLOPS:
        assert peak_bf16_flops(f"NVIDIA {key}") == peak, key
