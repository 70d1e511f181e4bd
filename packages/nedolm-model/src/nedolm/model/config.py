"""Model configuration and named presets.

`ModelConfig` holds plain JSON-serialisable fields so that `dataclasses.asdict(cfg)` can be
written into checkpoints and read back with `ModelConfig(**d)`. It validates itself on
construction and reports every bad field at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

MORPH_DISPATCHES = ("masked", "sparse", "grouped")
ATTN_IMPLS = ("auto", "flash", "torch_varlen", "flex", "sdpa")
VOCAB_MULTIPLE = 64  # embedding rows are padded so matmuls over the vocabulary stay aligned
# Llama 3.1 rotary scaling parameters, named as in Hugging Face configs.
LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


class ModelConfigError(ValueError):
    """A model configuration field (or preset name) is invalid; the message names it."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a MorphTransformer; `n_morph_classes == 0` is a plain Llama model."""

    vocab_size: int = 32003  # logical vocabulary: tokenizer ids + control ids + pad
    d_model: int = 256  # residual stream width
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # query heads; head_dim = d_model // n_heads
    n_kv_heads: int = 2  # key/value heads (grouped-query attention)
    ffn_dim: int = 704  # hidden width of the shared SwiGLU
    n_morph_classes: int = 0  # morph experts per block; 0 disables morph routing
    morph_expert_dim: int = 0  # hidden width of each morph expert's SwiGLU
    morph_dispatch: str = "masked"  # "masked", "sparse" or "grouped" (nedolm.model.morph)
    attn_impl: str = "auto"  # "auto", "flash", "torch_varlen", "flex" or "sdpa"
    max_seq_len: int = 1024  # longest sequence (rotary table length)
    rope_theta: float = 10000.0  # rotary base
    norm_eps: float = 1e-5  # RMSNorm epsilon
    init_std: float = 0.02  # std of weight init; residual projections are scaled down
    tie_embeddings: bool = True  # output head shares the input embedding (False: own weight)
    rope_scaling: dict[str, Any] | None = None  # None, or Llama 3.1's {"rope_type": "llama3", ...}

    def __post_init__(self) -> None:
        errors = _field_errors(self)
        if errors:
            raise ModelConfigError("invalid ModelConfig: " + "; ".join(errors))
        for name in ("rope_theta", "norm_eps", "init_std"):  # JSON may carry 10000 as an int
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _field_errors(cfg: ModelConfig) -> list[str]:
    errors: list[str] = []
    positive_ints = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")
    for name in (*positive_ints, "max_seq_len"):
        value = getattr(cfg, name)
        if not _is_int(value) or value <= 0:
            errors.append(f"{name} must be a positive int, got {value!r}")
    for name in ("n_morph_classes", "morph_expert_dim"):
        value = getattr(cfg, name)
        if not _is_int(value) or value < 0:
            errors.append(f"{name} must be an int >= 0, got {value!r}")
    for name in ("rope_theta", "norm_eps", "init_std"):
        value = getattr(cfg, name)
        if not _is_positive_number(value):
            errors.append(f"{name} must be a number > 0, got {value!r}")
    if not isinstance(cfg.tie_embeddings, bool):
        errors.append(f"tie_embeddings must be a bool, got {cfg.tie_embeddings!r}")
    errors.extend(_rope_scaling_errors(cfg.rope_scaling))
    if cfg.morph_dispatch not in MORPH_DISPATCHES:
        errors.append(
            f"morph_dispatch must be one of {MORPH_DISPATCHES}, got {cfg.morph_dispatch!r}"
        )
    elif cfg.morph_dispatch == "grouped" and not hasattr(torch, "_grouped_mm"):
        errors.append(
            f"morph_dispatch 'grouped' needs torch._grouped_mm (torch >= 2.8), "
            f"torch {torch.__version__} has none: use 'masked'"
        )
    if cfg.attn_impl not in ATTN_IMPLS:
        errors.append(f"attn_impl must be one of {ATTN_IMPLS}, got {cfg.attn_impl!r}")
    if errors:  # the divisibility checks below assume well-typed fields
        return errors
    if cfg.d_model % cfg.n_heads:
        errors.append(f"d_model ({cfg.d_model}) must be divisible by n_heads ({cfg.n_heads})")
    elif cfg.head_dim % 2:
        errors.append(f"head_dim d_model/n_heads = {cfg.head_dim} must be even for rotary")
    if cfg.n_heads % cfg.n_kv_heads:
        errors.append(f"n_heads ({cfg.n_heads}) must be divisible by n_kv_heads ({cfg.n_kv_heads})")
    if (cfg.n_morph_classes == 0) != (cfg.morph_expert_dim == 0):
        errors.append(
            "n_morph_classes and morph_expert_dim must both be 0 (dense) or both > 0, got "
            f"{cfg.n_morph_classes} and {cfg.morph_expert_dim}"
        )
    return errors


def _rope_scaling_errors(scaling: object) -> list[str]:
    if scaling is None:
        return []
    if not isinstance(scaling, dict) or scaling.get("rope_type") != "llama3":
        return [f"rope_scaling must be None or a dict with rope_type 'llama3', got {scaling!r}"]
    missing = sorted(set(LLAMA3_ROPE_KEYS) - set(scaling))
    extra = sorted(set(scaling) - set(LLAMA3_ROPE_KEYS) - {"rope_type"})
    if missing or extra:
        return [
            f"rope_scaling needs exactly {LLAMA3_ROPE_KEYS}: missing {missing}, unknown {extra}"
        ]
    bad = {k: scaling[k] for k in LLAMA3_ROPE_KEYS if not _is_positive_number(scaling[k])}
    if bad:
        return [f"rope_scaling values must be numbers > 0, got {bad}"]
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        return [f"rope_scaling high_freq_factor must exceed low_freq_factor, got {scaling}"]
    return []


def _is_positive_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_PRESETS: dict[str, dict[str, Any]] = {
    # CPU demos and tests: trains a few hundred steps in minutes on a laptop.
    "tiny": dict(
        d_model=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=704,
        n_morph_classes=3,
        morph_expert_dim=64,
        max_seq_len=1024,
    ),
    # ~0.78B parameters: head_dim 128 for the flash kernels, GQA 3:1.
    "nedolm-0.8b": dict(
        d_model=1536,
        n_layers=24,
        n_heads=12,
        n_kv_heads=4,
        ffn_dim=4096,
        n_morph_classes=3,
        morph_expert_dim=384,
        max_seq_len=4096,
        rope_theta=500000.0,
    ),
}


def preset_names() -> tuple[str, ...]:
    """Names accepted by `preset`."""
    return tuple(_PRESETS)


def preset(name: str, **overrides: Any) -> ModelConfig:
    """Return the named architecture, with `overrides` applied field by field.

    Raises:
        ModelConfigError: unknown preset name or override key, or an invalid resulting config.
    """
    if name not in _PRESETS:
        raise ModelConfigError(f"unknown model preset {name!r}; choose one of {preset_names()}")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ModelConfigError(f"unknown ModelConfig field(s) {unknown} for preset {name!r}")
    return ModelConfig(**{**_PRESETS[name], **overrides})
