"""The compile warm-up calls the training step's ``forward_backward`` with arguments of the same
kind and shape, so it compiles the graph that training then runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nedolm.train import compiling, step
from nedolm.train.config import load_sft_config
from nedolm.train.trainer import run


def _signature(model: torch.nn.Module, mb: step.MicroBatch, options: Any, scale: Any) -> tuple:
    """What decides the compiled graph: the callee and whether it runs compiled blocks, the loss
    options, each tensor's layout."""
    tensors = {
        name: (value.dtype, value.dim(), value.device.type)
        for name, value in vars(mb).items()
        if isinstance(value, torch.Tensor)
    }
    return (
        type(model).__name__,
        model.blocks_compiled and model.training,
        options,
        tensors,
        tuple(mb.inputs.shape),
        tuple(mb.labels.shape),
        type(scale),
    )


@pytest.mark.slow
@pytest.mark.parametrize("assistant_only_head", [True, False])
def test_warmup_and_step_call_the_same_function_with_the_same_arguments(
    make_config, monkeypatch, assistant_only_head: bool
) -> None:
    assert compiling.forward_backward is step.forward_backward  # one function, two callers
    real = step.forward_backward
    calls: list[tuple] = []

    def recording(model, mb, options, scale):  # the real function, its arguments recorded
        calls.append(_signature(model, mb, options, scale))
        return real(model, mb, options, scale)

    monkeypatch.setattr(compiling, "forward_backward", recording)
    monkeypatch.setattr(step, "forward_backward", recording)
    config = make_config(
        train={"compile": True, "max_steps": 1, "assistant_only_head": assistant_only_head},
        validation={"at_start": False},
    )
    run(load_sft_config(config), compile=True)
    log = (config.with_suffix("") / "train.log").read_text(encoding="utf-8")
    assert "compile warm-up done" in log and "torch.compile disabled" not in log
    warmup, *steps = calls
    assert len(steps) == 2  # grad_accum_steps micro-batches of the one optimizer step
    assert warmup[:2] == ("MorphTransformer", True)  # its blocks compiled, in training mode
    assert warmup[2].assistant_only_head is assistant_only_head
    assert all(call == warmup for call in steps), (warmup, steps)
