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
from nedolm.train.step import LossOptions, StepSettings, train_step

STEPS = 3


def scalar_reads(prof: profile) -> int:
    """``aten::_local_scalar_dense`` calls the profiler saw (every ``.item()``, ``int()``,
    ``bool()`` of a tensor, also one made inside another op's kernel), which on a GPU wait for
    the device to drain its queue. Those inside ``Optimizer.step`` are left out: CPU's fused AdamW
    reads each ``step`` counter, CUDA's keeps them on the device."""

    def in_optimizer(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("Optimizer.step"):
                return True
            parent = parent.cpu_parent
        return False

    reads = [e for e in prof.events() if e.name == "aten::_local_scalar_dense"]
    return sum(not in_optimizer(e) for e in reads)


@pytest.mark.parametrize("dispatch", ["masked", "grouped"])
def test_an_optimizer_step_reads_a_scalar_from_the_device_at_most_once(
    corpus: Path, harness, dispatch: str
):
    special = read_special_tokens(corpus)
    torch.manual_seed(0)
    # The static-shape dispatches (sparse dispatch indexes tokens by class, a read).
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
    train_step(model, params, optimizer, batches, settings, step=0)  # lazy state, first calls
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(1, 1 + STEPS):
            train_step(model, params, optimizer, batches, settings, step=step)
    reads = scalar_reads(prof)
    assert reads <= STEPS, f"{reads} scalar reads in {STEPS} optimizer steps"
