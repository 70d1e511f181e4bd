"""A training step reads the device at most once (per optimizer step, not per micro-batch or
per layer): the metadata of a micro-batch is derived on the CPU before it is copied over."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from nedolm.data.format import read_special_tokens
from nedolm.data.loader import build_sft_loader
from nedolm.dist import DistInfo
from nedolm.model import build_model, preset
from nedolm.train.profiling import scalar_reads
from nedolm.train.step import LossOptions, LossWindow, StepSettings, train_step

STEPS = 3


def tiny_step(corpus: Path, harness, dispatch: str = "masked"):
    """(model, params, optimizer, batches, settings) of a tiny run, its first step taken (lazy
    optimizer state and first calls done)."""
    special = read_special_tokens(corpus)
    torch.manual_seed(0)
    dims = {**harness.TINY, "vocab_size": special.vocab_size, "morph_dispatch": dispatch}
    model = build_model(preset("tiny", **dims))
    loader, _ = build_sft_loader(corpus, harness.SEQ_LEN, micro_batch_size=2, seed=3)
    batches = iter(loader)
    settings = StepSettings(
        DistInfo(0, 1, 0, torch.device("cpu")),
        special.eos_id,
        grad_accum_steps=2,
        grad_clip=1.0,
        loss=LossOptions(assistant_only_head=True, loss_fp32_logits=True, use_amp=False),
    )
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)  # as the trainer's on CUDA
    train_step(model, params, optimizer, batches, settings, step=0)
    return model, params, optimizer, batches, settings


# The static-shape dispatches (sparse dispatch indexes tokens by class, a read).
@pytest.mark.parametrize("dispatch", ["masked", "grouped"])
def test_an_optimizer_step_reads_a_scalar_from_the_device_at_most_once(
    corpus: Path, harness, dispatch: str
):
    model, params, optimizer, batches, settings = tiny_step(corpus, harness, dispatch)
    # acc_events: one cycle either way; without it torch 2.10/2.11 warn that cycles drop events.
    with profile(activities=[ProfilerActivity.CPU], acc_events=True) as prof:
        for step in range(1, 1 + STEPS):
            train_step(model, params, optimizer, batches, settings, step=step)
    reads = len(scalar_reads(prof.events()))
    assert reads <= STEPS, f"{reads} scalar reads in {STEPS} optimizer steps"


def test_a_logged_step_reads_its_loss_window_before_queueing_adamw(corpus: Path, harness):
    """The log line's loss is read right after the gradient norm, when the device has nothing
    queued; read after ``optimizer.step()`` it would wait for AdamW to finish."""
    model, params, optimizer, batches, settings = tiny_step(corpus, harness)
    window = LossWindow(torch.device("cpu"))
    losses = []
    for step in (1, 2):
        result = train_step(model, params, optimizer, batches, settings, step, loss_window=window)
        losses.append(float(result.loss_sum))
    assert window.value is None  # not asked to read
    window.read_now = True
    with profile(activities=[ProfilerActivity.CPU], acc_events=True) as prof:
        result = train_step(model, params, optimizer, batches, settings, 3, loss_window=window)
    losses.append(float(result.loss_sum))
    assert window.value == pytest.approx(sum(losses), rel=1e-6)
    reads = scalar_reads(prof.events())
    assert len(reads) == 2  # the gradient norm and the window
    optimizer = [e for e in prof.events() if e.name.startswith("Optimizer.step")]
    assert max(e.time_range.start for e in reads) < optimizer[0].time_range.start
