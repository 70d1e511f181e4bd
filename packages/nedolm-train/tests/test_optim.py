"""Schedules against their closed-form definitions, and the optimizer's decay groups."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from nedolm.train.config import OptimConfig
from nedolm.train.optim import build_optimizer, lr_at_step, set_lr


def _cfg(**kw: object) -> OptimConfig:
    return OptimConfig(**{"lr": 1.0, "min_lr_ratio": 0.1, "warmup_steps": 4, **kw})


def test_warmup_is_linear_up_to_peak() -> None:
    cfg = _cfg(schedule="constant")
    assert [lr_at_step(s, cfg, 20) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_cosine_endpoints_and_midpoint() -> None:
    cfg = _cfg(schedule="cosine")
    # 4 warm-up steps, then steps 4..24 (21 steps) go from 1.0 to 0.1.
    values = [lr_at_step(s, cfg, 25) for s in range(25)]
    assert values[4] == pytest.approx(1.0)
    assert values[14] == pytest.approx(0.55)
    assert values[24] == pytest.approx(0.1)
    for s in range(4, 25):
        expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 4) / 20))
        assert values[s] == pytest.approx(expected)


def test_linear_decays_in_equal_steps() -> None:
    cfg = _cfg(schedule="linear", warmup_steps=0)
    values = [lr_at_step(s, cfg, 10) for s in range(10)]
    diffs = [a - b for a, b in itertools.pairwise(values)]
    assert values[0] == 1.0 and values[-1] == pytest.approx(0.1)
    assert diffs == pytest.approx([0.1] * 9)


def test_wsd_is_flat_then_decays_over_decay_fraction() -> None:
    cfg = _cfg(schedule="wsd", warmup_steps=2, decay_fraction=0.25)
    # 22 steps: warm-up 0..1, span 20, decay over the last 5 steps (17..21) to 0.1.
    values = [lr_at_step(s, cfg, 22) for s in range(22)]
    assert values[:2] == [0.5, 1.0]
    assert values[2:17] == [1.0] * 15
    assert values[17:] == pytest.approx([1.0, 0.775, 0.55, 0.325, 0.1])


def test_schedule_never_leaves_its_range_and_rejects_bad_steps() -> None:
    for schedule in ("cosine", "linear", "wsd", "constant"):
        cfg = _cfg(schedule=schedule)
        for s in range(0, 60):
            assert 0.0 < lr_at_step(s, cfg, 50) <= 1.0  # steps past the end stay at the floor
    with pytest.raises(ValueError, match="max_steps"):
        lr_at_step(0, _cfg(), 0)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4, bias=False)
        self.norm = nn.RMSNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied, as in NedoLM


@pytest.mark.parametrize("decay_all", [False, True])
def test_decay_groups_follow_config(decay_all: bool) -> None:
    torch.manual_seed(0)
    model = _Tiny()
    cfg = OptimConfig(lr=0.1, weight_decay=0.5, decay_norms_and_embeddings=decay_all)
    opt = build_optimizer(model, cfg)
    assert sum(len(g["params"]) for g in opt.param_groups) == 3  # tied weight counted once
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # zero gradient: AdamW moves a param only by its decay
    opt.step()
    shrunk = 1 - 0.1 * 0.5
    torch.testing.assert_close(model.proj.weight, before["proj.weight"] * shrunk)
    for name in ("emb.weight", "norm.weight"):
        expected = before[name] * shrunk if decay_all else before[name]
        torch.testing.assert_close(dict(model.named_parameters())[name], expected)


def test_set_lr_sets_every_group() -> None:
    opt = build_optimizer(_Tiny(), OptimConfig())
    set_lr(opt, 0.123)
    assert [g["lr"] for g in opt.param_groups] == [0.123, 0.123]
