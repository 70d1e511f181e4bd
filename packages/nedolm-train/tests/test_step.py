"""The step against an independent computation, and its fail-closed paths (in-process)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nedolm.data.format import read_special_tokens
from nedolm.data.loader import build_sft_loader
from nedolm.dist import DistInfo
from nedolm.model import build_model, preset
from nedolm.model.attention import build_layout
from nedolm.train.step import (
    LossOptions,
    StepError,
    StepSettings,
    clip_grad_norm,
    fetch_step_batches,
    loss_sum,
    to_micro_batch,
    train_step,
)
from nedolm.train.testing import OpNames
from nedolm.train.validation import run_validation

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
FUSED = LossOptions(assistant_only_head=True, loss_fp32_logits=True, use_amp=False)


def _settings(eos_id: int, *, grad_clip: float = 1.0, loss: LossOptions = FUSED) -> StepSettings:
    return StepSettings(CPU, eos_id, grad_accum_steps=2, grad_clip=grad_clip, loss=loss)


@pytest.fixture(scope="module")
def batches(corpus: Path, harness) -> list[dict[str, torch.Tensor]]:
    loader, _ = build_sft_loader(corpus, harness.SEQ_LEN, micro_batch_size=2, seed=3)
    return list(itertools.islice(iter(loader), 3))


@pytest.fixture
def model(corpus: Path, harness) -> torch.nn.Module:
    torch.manual_seed(0)
    vocab = read_special_tokens(corpus).vocab_size
    return build_model(preset("tiny", **{**harness.TINY, "vocab_size": vocab}))


def _slow_positions(row: list[int], eos_id: int) -> list[int]:
    """Rotary position of every token: restarts after each EOS (reference for the layout)."""
    out, pos = [], 0
    for token in row:
        out.append(pos)
        pos = 0 if token == eos_id else pos + 1
    return out


def _reference_loss(model, batch_list, eos_id: int) -> tuple[torch.Tensor, int]:
    """Every document of every row alone, full logits, summed CE over its targets."""
    total, targets = torch.zeros(()), 0
    for batch in batch_list:
        tokens, mask = batch["tokens"], batch["trainable_mask"]
        for row, row_mask in zip(tokens.tolist(), mask.tolist(), strict=True):
            positions = _slow_positions(row[:-1], eos_id)
            starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
            for a, b in itertools.pairwise(starts):
                ids = torch.tensor(row[a:b])[None]
                labels = torch.tensor(
                    [
                        t if m else -100
                        for t, m in zip(row[a + 1 : b + 1], row_mask[a + 1 : b + 1], strict=True)
                    ]
                )[None]
                if (labels != -100).any():
                    _, logits = model(ids, return_logits=True)
                    total = total + F.cross_entropy(logits[0], labels[0], reduction="sum")
                    targets += int((labels != -100).sum())
    return total, targets


def test_micro_batch_labels_follow_the_mask(batches, corpus) -> None:
    eos = read_special_tokens(corpus).eos_id
    mb = to_micro_batch(batches[0], torch.device("cpu"), eos)
    mask = batches[0]["trainable_mask"]
    assert not mask[:, 0].any()  # position 0 of a window is never a target
    expected = torch.where(mask[:, 1:], batches[0]["tokens"][:, 1:], -100)
    assert torch.equal(mb.labels, expected) and mb.targets == int(mask.sum())
    rows = batches[0]["tokens"][:, :-1].tolist()
    assert mb.position_ids.tolist() == [_slow_positions(r, eos) for r in rows]


def test_the_model_gets_the_micro_batchs_cpu_offsets(model, batches, corpus, monkeypatch) -> None:
    """On a GPU the sdpa backend would otherwise read cu_seqlens back in every forward (a wait
    for all queued work): the model's test shows it plans from this copy instead."""
    from nedolm.model import model as model_module

    given = []

    def recording_build_layout(*args, **kwargs):
        given.append(kwargs["host_cu_seqlens"])
        return build_layout(*args, **kwargs)

    monkeypatch.setattr(model_module, "build_layout", recording_build_layout)
    mb = to_micro_batch(batches[0], torch.device("cpu"), read_special_tokens(corpus).eos_id)
    loss_sum(model, mb, FUSED)
    assert len(given) == 1 and given[0] is mb.host_cu_seqlens
    assert given[0].device.type == "cpu" and torch.equal(given[0], mb.cu_seqlens)


@pytest.mark.parametrize("head", [True, False])
def test_step_gradient_is_the_exact_global_target_mean(model, batches, corpus, head) -> None:
    """SGD(lr=1): the weight change is minus the gradient of (sum of target losses / targets)."""
    eos = read_special_tokens(corpus).eos_id
    reference = copy.deepcopy(model)
    micro = [to_micro_batch(b, torch.device("cpu"), eos) for b in batches[:2]]
    targets = sum(mb.targets for mb in micro)
    assert micro[0].targets != micro[1].targets  # a per-micro-batch mean would differ
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    options = LossOptions(assistant_only_head=head, loss_fp32_logits=True, use_amp=False)
    params = list(model.parameters())
    result = train_step(
        model,
        params,
        torch.optim.SGD(params, lr=1.0),
        iter(batches[:2]),
        _settings(eos, grad_clip=1e9, loss=options),
        step=0,
    )
    ref_sum, ref_targets = _reference_loss(reference, batches[:2], eos)
    assert ref_targets == targets == result.global_targets
    torch.testing.assert_close(result.loss_sum, ref_sum.detach(), rtol=1e-5, atol=1e-4)
    (ref_sum / ref_targets).backward()
    for name, param in reference.named_parameters():
        step = before[name] - dict(model.named_parameters())[name].detach()
        torch.testing.assert_close(step, param.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_non_finite_gradient_stops_the_step(model, batches, corpus) -> None:
    eos = read_special_tokens(corpus).eos_id
    with torch.no_grad():
        model.norm.weight.fill_(float("inf"))
    params = list(model.parameters())
    with pytest.raises(StepError, match="non-finite gradient norm at optimizer step 7"):
        train_step(
            model, params, torch.optim.SGD(params, lr=1.0), iter(batches), _settings(eos), step=7
        )


def _with_grads(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    return params


def test_clip_norm_is_exact_and_the_same_for_a_whole_or_row_sharded_gradient() -> None:
    """DDP's norm sums a gradient's squares over the whole tensor, FSDP's per row shard: both
    must clip by the same factor (a float32 sum over this 32k-row embedding misses by ~1e-5)."""
    grad = torch.randn(32064, 64, generator=torch.Generator().manual_seed(0)) * 1e-3
    exact = float(grad.double().norm())
    whole, halves = _with_grads([grad]), _with_grads(list(grad.chunk(2)))
    assert clip_grad_norm(whole, 0.01) == pytest.approx(exact, rel=1e-12)
    assert clip_grad_norm(halves, 0.01) == pytest.approx(exact, rel=1e-12)
    assert torch.equal(whole[0].grad, torch.cat([p.grad for p in halves]))
    assert float(whole[0].grad.double().norm()) == pytest.approx(0.01, rel=1e-6)


@pytest.mark.parametrize("headroom", [-0.5, 0.0, 1.0])  # 0: torch's factor is exactly 1.0
def test_clip_equals_torch_and_skips_the_pass_torch_would_multiply_by_one(headroom) -> None:
    grads = [torch.randn(5, 3, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    norm = clip_grad_norm(_with_grads(grads), math.inf)
    max_norm = norm + 1e-6 + headroom
    ours, reference = _with_grads(grads), _with_grads(grads)
    with (ops := OpNames()):
        assert clip_grad_norm(ours, max_norm) == norm
    total = torch.tensor(norm, dtype=torch.float64)
    torch.nn.utils.clip_grads_with_norm_(reference, max_norm, total, foreach=True)
    for got, want in zip(ours, reference, strict=True):
        assert torch.equal(got.grad, want.grad)
    assert ("_foreach_mul_" in ops.names) == (headroom < 0)
    assert ops.names.count("_local_scalar_dense") == 1  # the norm's one read


def _without_targets(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    mask = torch.zeros_like(batch["trainable_mask"])
    return {**batch, "trainable_mask": mask, "trainable_tokens": mask.sum(1)}


def test_fetch_counts_targets_and_the_loader_owns_the_cursor(corpus, harness) -> None:
    eos = read_special_tokens(corpus).eos_id
    loader, _ = build_sft_loader(corpus, harness.SEQ_LEN, micro_batch_size=2, seed=3)
    seen = list(itertools.islice(iter(loader), 2))
    loader, _ = build_sft_loader(corpus, harness.SEQ_LEN, micro_batch_size=2, seed=3)
    assert loader.state_dict() == {}
    micro, targets, stop = fetch_step_batches(iter(loader), _settings(eos), step=0, local_stop=True)
    assert stop  # this rank's request, agreed on in the same all-reduce
    assert [mb.targets for mb in micro] == [int(b["trainable_mask"].sum()) for b in seen]
    assert targets == sum(int(b["trainable_mask"][:, 1:].sum()) for b in seen)
    assert loader.state_dict() == {"0": seen[1]["state"][-1].tolist()}


def test_a_single_process_fetches_a_step_without_reading_the_device(batches, corpus) -> None:
    """Nothing to agree on with one rank: the step's status stays on the host, so its forward
    pass is queued behind the previous step's kernels without waiting for them. The meta device
    holds no data: any read back from it would raise."""
    eos = read_special_tokens(corpus).eos_id
    settings = dataclasses.replace(_settings(eos), info=DistInfo(0, 1, 0, torch.device("meta")))
    micro, targets, stop = fetch_step_batches(iter(batches), settings, step=0, local_stop=True)
    assert {mb.inputs.device.type for mb in micro} == {"meta"} and stop
    assert targets == sum(int(b["trainable_mask"][:, 1:].sum()) for b in batches[:2])


def test_zero_target_step_fails_closed(batches, corpus) -> None:
    eos = read_special_tokens(corpus).eos_id
    empty = [_without_targets(b) for b in batches[:2]]
    with pytest.raises(StepError, match="optimizer step 5 has zero assistant targets"):
        fetch_step_batches(iter(empty), _settings(eos), step=5, local_stop=False)
    with pytest.raises(StepError, match="StopIteration"):
        fetch_step_batches(iter(batches[:1]), _settings(eos), step=5, local_stop=False)


def test_validation_is_the_exact_mean_and_refuses_zero_targets(model, batches, corpus) -> None:
    eos = read_special_tokens(corpus).eos_id
    result = run_validation(model, batches, CPU, batches=3, eos_id=eos, options=FUSED)
    ref_sum, ref_targets = _reference_loss(model, batches, eos)
    assert result.targets == ref_targets
    assert result.loss == pytest.approx(float(ref_sum.detach()) / ref_targets, rel=1e-5)
    assert model.training  # restored
    empty = [_without_targets(b) for b in batches]
    with pytest.raises(StepError, match="zero assistant targets"):
        run_validation(model, empty, CPU, batches=3, eos_id=eos, options=FUSED)
