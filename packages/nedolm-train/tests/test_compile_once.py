"""The compiled training forward is traced once: no graph break, and at most one recompile
over 30 steps of a real corpus (every micro-batch a new packing and target count)."""

from __future__ import annotations

import pytest
import torch

from nedolm.dist import DistInfo
from nedolm.model import AttentionBackendError, ModelConfig, build_model
from nedolm.train.compiling import compile_and_warm_up
from nedolm.train.config import load_sft_config
from nedolm.train.metrics import read_metrics
from nedolm.train.step import LossOptions, StepSettings
from nedolm.train.trainer import run

STEPS = 30

# Warnings torch raises while compiling (inductor's imports, dynamo's probes).
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
]


def test_thirty_compiled_steps_have_no_graph_break_and_at_most_one_recompile(make_config):
    from torch._dynamo.utils import counters

    config = make_config(
        train={"compile": True, "max_steps": STEPS, "grad_accum_steps": 1, "ckpt_interval": 1000},
        validation={"at_start": False, "interval": 1000},
    )
    torch._dynamo.reset()
    counters.clear()
    run(load_sft_config(config), compile=True)
    graph_breaks = dict(counters["graph_break"])
    frames = counters["frames"]["ok"]
    assert graph_breaks == {}, graph_breaks
    assert 1 <= frames <= 2, f"{frames} frames compiled: {frames - 1} recompiles"
    run_dir = config.with_suffix("")
    assert max(r["step"] for r in read_metrics(run_dir) if "loss" in r) == STEPS
    log = (run_dir / "train.log").read_text(encoding="utf-8")
    assert "0 graph break(s)" in log and "torch.compile disabled" not in log


def test_a_backend_failing_in_the_warm_up_is_named_not_called_a_compile_failure(
    caplog,
) -> None:
    """flex has no CPU backward in torch 2.13 (the run's start-up probe refuses it; here the
    warm-up meets it unprobed): the warm-up fails compiled and eagerly, so it raises naming the
    backend instead of falling back to an eager run that would fail the same way."""
    dims = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
    model = build_model(ModelConfig(vocab_size=101, attn_impl="flex", **dims))
    settings = StepSettings(
        DistInfo(0, 1, 0, torch.device("cpu")),
        eos_id=2,
        grad_accum_steps=1,
        grad_clip=1.0,
        loss=LossOptions(assistant_only_head=True, loss_fp32_logits=True, use_amp=False),
    )
    with pytest.raises(
        AttentionBackendError, match=r"attention backend \(attn_impl='flex'\).*not a compile"
    ):
        compile_and_warm_up(model, settings, micro_batch=1, seq_len=64, backend="aot_eager")
    assert "torch.compile disabled" not in caplog.text
