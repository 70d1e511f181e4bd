"""Shared fixtures: a model small enough that every test runs in well under a second."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from nedolm.model import ModelConfig, MorphTransformer, build_model


def small_config(**overrides: object) -> ModelConfig:
    fields: dict[str, object] = dict(
        vocab_size=203,  # padded to 256: exercises the padding rows
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=96,
        n_morph_classes=3,
        morph_expert_dim=16,
        max_seq_len=128,
        attn_impl="sdpa",
    )
    return ModelConfig(**{**fields, **overrides})


def small_model(seed: int = 0, **overrides: object) -> MorphTransformer:
    torch.manual_seed(seed)
    model = build_model(small_config(**overrides))
    if model.cfg.n_morph_classes:
        classes = torch.randint(0, model.cfg.n_morph_classes, (model.cfg.vocab_size,))
        model.set_morph_classes(classes)
    return model


@pytest.fixture
def make_model() -> Callable[..., MorphTransformer]:
    """`make_model(seed=0, **config_overrides)`: a seeded small model with random morph classes."""
    return small_model


@pytest.fixture
def make_config() -> Callable[..., ModelConfig]:
    return small_config


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # the CPU is shared; small shapes gain nothing from threads
