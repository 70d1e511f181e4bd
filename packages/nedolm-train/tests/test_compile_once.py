"""The compiled training forward is traced once: no graph break and no recompile over 30 steps
of a real corpus (every micro-batch a new packing, target count and longest segment)."""

from __future__ import annotations

import pytest
import torch

from nedolm.dist import DistInfo
from nedolm.model import AttentionBackendError, ModelConfig, build_model
from nedolm.model.attention import build_layout, varlen_attention
from nedolm.train.compiling import compile_and_warm_up, trace_longest_segment_dynamically
from nedolm.train.config import load_sft_config
from nedolm.train.metrics import read_metrics
from nedolm.train.step import LossOptions, StepSettings, loss_sum, to_micro_batch
from nedolm.train.trainer import run

STEPS = 30

# Warnings torch raises while compiling (inductor's imports, dynamo's probes).
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
]


def test_thirty_compiled_steps_have_no_graph_break_and_no_recompile(make_config):
    """Validation passes in between (eval mode, rows sliced by source) run the blocks eagerly;
    steps 12-14 run under the profiler (``profile.start_step``), which recompiles nothing."""
    from torch._dynamo.utils import counters

    config = make_config(
        train={"compile": True, "max_steps": STEPS, "grad_accum_steps": 1, "ckpt_interval": 1000},
        validation={"at_start": True, "interval": 10},
        profile={"start_step": 12, "steps": 3},
    )
    torch._dynamo.reset()
    counters.clear()
    run(load_sft_config(config), compile=True)
    graph_breaks = dict(counters["graph_break"])
    frames = counters["frames"]["ok"]
    assert graph_breaks == {}, graph_breaks
    # Every micro-batch has a new longest segment too: traced as a symbol, it recompiles nothing.
    assert frames == 1, f"{frames} frames compiled: {frames - 1} recompiles"
    run_dir = config.with_suffix("")
    records = read_metrics(run_dir)
    assert max(r["step"] for r in records if "loss" in r) == STEPS
    assert len([r for r in records if r.get("kind") == "validation"]) >= 3
    log = (run_dir / "train.log").read_text(encoding="utf-8")
    assert "1 frame(s) compiled, 0 graph break(s)" in log
    assert "torch.compile disabled" not in log and "recompiled" not in log
    assert (run_dir / "profile" / "steps-12-14" / "rank0.summary.json").is_file()


LONGEST_SEEN: list[int] = []


@torch.library.custom_op("nedolm_test::recording_varlen", mutates_args=())
def _recording_varlen(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq: torch.Tensor, max_q: int
) -> torch.Tensor:
    """A kernel op as torch's varlen_attn is one: records the max_seqlen it was handed."""
    LONGEST_SEEN.append(max_q)
    layout = build_layout("sdpa", cu_seq, None, query.size(0))
    return varlen_attention(query, key, value, layout)


@_recording_varlen.register_fake
def _(query, key, value, cu_seq, max_q):
    return torch.empty_like(query)


def varlen_attn_with_torch_2_11_signature(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
    window_size=(-1, -1),
):  # fmt: skip
    assert window_size == (-1, 0) and max_q == max_k
    return _recording_varlen(query, key, value, cu_seq_q, max_q)


@pytest.mark.parametrize("how", ["blocks", "model"])
def test_a_kernel_backend_gets_each_micro_batchs_longest_segment_and_nothing_recompiles(
    monkeypatch, how: str
) -> None:
    """torch_varlen's grid is sized by max_seqlen: each micro-batch hands it the longest
    conversation it holds (not the row length), traced as a symbol, so one compiled graph
    serves every value: in a compiled block's layout (the trainer's way) and as the argument
    of a whole-model compile."""
    from torch._dynamo.utils import counters

    from nedolm.model import attn_select as select

    torch_varlen_present_on_cpu(monkeypatch)
    dims = dict(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    model = build_model(ModelConfig(vocab_size=101, attn_impl="torch_varlen", **dims))
    reference = build_model(model.cfg)
    reference.load_state_dict(model.state_dict())
    options = LossOptions(assistant_only_head=True, loss_fp32_logits=True, use_amp=True)
    select.resolve_attn_impl("torch_varlen", "cpu", torch.bfloat16, backward=False)  # as a run
    assert trace_longest_segment_dynamically()
    torch._dynamo.reset()
    counters.clear()
    if how == "model":
        compiled = torch.compile(model, backend="aot_eager")
    else:
        model.compile_blocks(backend="aot_eager")
        compiled = model
    want = []
    for seed, boundaries in enumerate([(7, 20), (30, 33, 40), (3, 50), (12, 24, 36)]):
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(3, 101, (2, 65), generator=gen)
        tokens[:, list(boundaries)] = 2  # EOS ends a conversation
        mask = torch.rand(2, 65, generator=gen) < 0.5
        mb = to_micro_batch({"tokens": tokens, "trainable_mask": mask}, torch.device("cpu"), 2)
        lengths = mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]
        assert mb.max_seqlen == int(lengths.max())
        want.append(mb.max_seqlen)
        LONGEST_SEEN.clear()
        with torch.no_grad():
            got = loss_sum(compiled, mb, options)
            eager = loss_sum(reference, mb, options)
        torch.testing.assert_close(got, eager)
        assert set(LONGEST_SEEN) == {mb.max_seqlen}, (LONGEST_SEEN, mb.max_seqlen)
    assert len(set(want)) > 1 and counters["frames"]["ok"] == 1


def torch_varlen_present_on_cpu(monkeypatch) -> None:
    """torch_varlen made present on this CPU with a stand-in kernel of torch 2.11's signature
    (a custom op, as torch's is, whose forward runs sdpa and which has no backward)."""
    from nedolm.model import attention
    from nedolm.model import attn_select as select

    monkeypatch.setattr(attention, "varlen_attn", varlen_attn_with_torch_2_11_signature)
    monkeypatch.setattr(attention, "_varlen_native_gqa", {})
    monkeypatch.setattr(select, "_probed", {})
    monkeypatch.setattr(select, "_resolved", {})
    present = {**select.attention_backends("cpu"), "torch_varlen": None}
    monkeypatch.setattr(select, "attention_backends", lambda device: present)


def test_a_backend_failing_in_the_warm_up_is_named_not_called_a_compile_failure(
    monkeypatch, caplog
) -> None:
    """A backend whose forward runs but whose backward cannot (as flex on a CPU in torch 2.13;
    the run's start-up probe refuses it, here the warm-up meets it unprobed): the warm-up fails
    compiled and eagerly, so it raises naming the backend instead of falling back to an eager
    run that would fail the same way."""
    torch_varlen_present_on_cpu(monkeypatch)
    dims = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64)
    model = build_model(ModelConfig(vocab_size=101, attn_impl="torch_varlen", **dims))
    settings = StepSettings(
        DistInfo(0, 1, 0, torch.device("cpu")),
        eos_id=2,
        grad_accum_steps=1,
        grad_clip=1.0,
        loss=LossOptions(assistant_only_head=True, loss_fp32_logits=True, use_amp=False),
    )
    with pytest.raises(
        AttentionBackendError,
        match=r"attention backend \(attn_impl='torch_varlen'\).*not a compile",
    ):
        compile_and_warm_up(model, settings, micro_batch=1, seq_len=64, backend="aot_eager")
    assert "torch.compile disabled" not in caplog.text
