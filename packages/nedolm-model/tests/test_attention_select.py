"""`auto` takes only a backend whose start-up forward+backward probe passed, and says why."""

import logging
import subprocess
import sys

import pytest
import torch

from nedolm.model import AttentionBackendError, attention_backends, probe_backends
from nedolm.model import attn_select as select
from nedolm.model.attention import BACKENDS, build_layout, varlen_attention


@pytest.fixture(autouse=True)
def fresh_probes(monkeypatch) -> None:
    """Each test sees an unprobed process."""
    monkeypatch.setattr(select, "_probed", {})
    monkeypatch.setattr(select, "_resolved", {})


def test_auto_on_cpu_is_sdpa_and_the_log_says_why_not_the_others(caplog) -> None:
    caplog.set_level(logging.INFO, logger="nedolm.model.attn_select")
    with torch.no_grad():  # the probe's backward runs whatever the caller's grad mode
        assert select.resolve_attn_impl("auto", "cpu") == "sdpa"
    [record] = [r for r in caplog.records if r.name == "nedolm.model.attn_select"]
    message = record.getMessage()
    assert message.startswith("attn_impl auto: sdpa on cpu in torch.float32")
    assert "torch_varlen: torch.nn.attention.varlen needs a CUDA device" in message
    assert "flex" not in message, "flex comes after sdpa off CUDA: never probed here"
    reasons = probe_backends("cpu")
    assert reasons["sdpa"] is None
    # FlexAttention's CPU backward: present in torch 2.10, NotImplementedError in 2.13.
    assert reasons["flex"] is None or "NotImplementedError" in reasons["flex"]
    assert reasons["flash"] == attention_backends("cpu")["flash"]


def test_auto_off_cuda_prefers_sdpa_to_flex_even_where_flex_trains() -> None:
    """torch 2.10's flex has a CPU backward; `auto` took it and the demo trained 7x slower."""
    select._probed[("flex", torch.device("cpu"), torch.float32, True)] = None  # as on 2.10
    assert select.resolve_attn_impl("auto", "cpu") == "sdpa"
    assert select.auto_order("cpu") == ("flash", "torch_varlen", "sdpa", "flex")
    assert select.auto_order("cuda") == BACKENDS  # measured on an H200: flex ahead of sdpa


def sdpa_computed(query, key, value, cu_seq_q):
    total = query.size(0)
    return varlen_attention(query, key, value, build_layout("sdpa", cu_seq_q, None, total))


def kernel_with_torch_2_11_signature(behaviour):
    calls = []

    def varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
        window_size=(-1, -1),
    ):  # fmt: skip
        calls.append((window_size, key.size(1)))
        return behaviour(query, key, value, cu_seq_q)

    return varlen_attn, calls


def torch_varlen_present_with_torch_2_11_signature(monkeypatch, behaviour) -> list:
    """torch_varlen made present on CPU (its kernel is CUDA-only); returns the kernel's calls:
    (window_size, KV heads) each."""
    from nedolm.model import attention

    kernel, calls = kernel_with_torch_2_11_signature(behaviour)
    monkeypatch.setattr(attention, "varlen_attn", kernel)
    monkeypatch.setattr(attention, "_varlen_native_gqa", {})
    monkeypatch.setattr(
        select,
        "attention_backends",
        lambda device: {**attention_backends(device), "torch_varlen": None},
    )
    return calls


def broken(query, key, value, cu_seq_q):
    raise RuntimeError("CUDA error: no kernel image is available for execution on the device")


def mixes_tokens_up(query, key, value, cu_seq_q):
    return sdpa_computed(query, key, value, cu_seq_q).flip(0)


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out):
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("no backward kernel for this device")


def test_a_named_backend_that_cannot_train_here_is_refused_for_training(monkeypatch) -> None:
    torch_varlen_present_with_torch_2_11_signature(
        monkeypatch, lambda *args: _NoBackward.apply(sdpa_computed(*args))
    )
    with pytest.raises(
        AttentionBackendError, match=r"'torch_varlen' cannot train on cpu.*NotImplementedError"
    ):
        select.resolve_attn_impl("torch_varlen", "cpu", torch.bfloat16)
    assert select.resolve_attn_impl("torch_varlen", "cpu", torch.bfloat16, backward=False) == (
        "torch_varlen"
    )
    assert select.resolve_attn_impl("auto", "cpu", torch.bfloat16) == "sdpa"


@pytest.mark.parametrize(
    ("behaviour", "chosen", "rejection"),
    [
        (sdpa_computed, "torch_varlen", None),
        (broken, "sdpa", "torch_varlen: forward+backward probe failed: RuntimeError: CUDA error"),
        (mixes_tokens_up, "sdpa", "torch_varlen: forward+backward probe failed: output differs"),
    ],
)
def test_auto_takes_a_present_backend_only_when_its_probe_passes(
    monkeypatch, caplog, behaviour, chosen, rejection
) -> None:
    """torch_varlen made present on CPU (its kernel is CUDA-only) with torch 2.11's signature."""
    calls = torch_varlen_present_with_torch_2_11_signature(monkeypatch, behaviour)
    caplog.set_level(logging.INFO, logger="nedolm.model.attn_select")
    assert select.resolve_attn_impl("auto", "cpu", torch.bfloat16) == chosen
    probed = len(calls)
    assert probed >= 1 and {window for window, _ in calls} == {(-1, 0)}
    assert select.resolve_attn_impl("auto", "cpu", torch.bfloat16) == chosen
    assert len(calls) == probed, "probed once per device and dtype"
    if rejection is not None:
        assert rejection in caplog.records[-1].getMessage()
        with pytest.raises(AttentionBackendError, match="'torch_varlen' cannot run here"):
            select.resolve_attn_impl("torch_varlen", "cpu", torch.bfloat16)


def pairs_query_head_h_with_kv_head_h_mod_g(query, key, value, cu_seq_q):
    """A kernel that takes fewer KV heads but groups them wrongly (h % G, not h // n_rep)."""
    n_rep = query.size(1) // key.size(1)
    key, value = (t.repeat(1, n_rep, 1) for t in (key, value))
    return sdpa_computed(query, key, value, cu_seq_q)


def needs_equal_heads(query, key, value, cu_seq_q):
    if query.size(1) != key.size(1):
        raise RuntimeError("Number of heads in key/value must equal the query's")
    return sdpa_computed(query, key, value, cu_seq_q)


@pytest.mark.parametrize(
    ("behaviour", "mode", "kv_heads_passed", "logged"),
    [
        (sdpa_computed, "native", 2, "takes grouped KV heads unexpanded"),
        (pairs_query_head_h_with_kv_head_h_mod_g, "expanded", 6, "output differs"),
        (needs_equal_heads, "expanded", 6, "RuntimeError: Number of heads"),
    ],
)
def test_torch_2_11_varlen_attn_gets_unexpanded_kv_heads_only_once_that_is_proven(
    monkeypatch, caplog, behaviour, mode, kv_heads_passed, logged
) -> None:
    """torch 2.10/2.11's varlen_attn has no enable_gqa; grouped heads go to it as they are only
    if its output and gradients match the reference that way, and training is right either way."""
    from nedolm.model import varlen_gqa_mode

    calls = torch_varlen_present_with_torch_2_11_signature(monkeypatch, behaviour)
    assert varlen_gqa_mode() == "unproven"
    caplog.set_level(logging.INFO, logger="nedolm.model.attn_select")
    assert select.resolve_attn_impl("auto", "cpu", torch.bfloat16) == "torch_varlen"
    assert varlen_gqa_mode() == mode
    assert any(logged in r.getMessage() for r in caplog.records)
    torch.manual_seed(0)
    cu_seqlens = torch.tensor([0, 5, 6, 15, 45])
    exact = [torch.randn(45, heads, 8) for heads in (6, 2, 2)]  # GQA 3:1
    grad = torch.randn(45, 6, 8, dtype=torch.bfloat16)
    results = []
    for impl in ("torch_varlen", "sdpa"):
        inputs = [t.bfloat16().requires_grad_() for t in exact]
        out = varlen_attention(*inputs, build_layout(impl, cu_seqlens, None, 45))
        results.append((out, *torch.autograd.grad(out, inputs, grad)))
    assert calls[-1] == ((-1, 0), kv_heads_passed)
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_a_varlen_attn_with_enable_gqa_is_told_so_and_needs_no_verdict(monkeypatch) -> None:
    from nedolm.model import attention, varlen_gqa_mode

    def varlen_attn_2_12(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
        window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
    ):  # fmt: skip
        assert enable_gqa and window_size == (-1, 0)
        return sdpa_computed(query, key, value, cu_seq_q)

    monkeypatch.setattr(attention, "varlen_attn", varlen_attn_2_12)
    monkeypatch.setattr(attention, "_varlen_native_gqa", {})
    assert varlen_gqa_mode() == "keyword"
    monkeypatch.setattr(
        select,
        "attention_backends",
        lambda device: {**attention_backends(device), "torch_varlen": None},
    )
    assert select.resolve_attn_impl("torch_varlen", "cpu", torch.bfloat16) == "torch_varlen"
    assert attention._varlen_native_gqa == {}, "no grouped-heads probe for a kernel that says"


def test_an_inference_process_never_imports_the_compiler() -> None:
    """``generate``, ``chat`` and ``export`` import the model, pick its backend (the probes
    included) and run it eagerly: none of that needs torch._dynamo, whose import cost each of
    them a second. (Training imports it anyway: torch's custom ops, the fused loss head's
    among them, import it at their first call.)"""
    code = """
import sys
import torch
from nedolm.model import build_model, generate, packed_layout, preset, resolve_attn_impl
assert resolve_attn_impl("auto", "cpu") == "sdpa"  # the forward+backward probes
trained = build_model(preset("tiny", vocab_size=64, max_seq_len=32)).state_dict()
model = build_model(preset("tiny", vocab_size=64, max_seq_len=32), init_weights=False)
model.load_state_dict(trained)  # as generate, chat and export load a checkpoint
ids = torch.randint(3, 64, (1, 16))
ids[0, 7] = 2
cu_seqlens, position_ids = packed_layout(ids, 2)
model(ids, cu_seqlens=cu_seqlens, max_seqlen=8, position_ids=position_ids)
list(generate(model, [5, 6, 7], max_new_tokens=4))
assert "torch._dynamo" not in sys.modules, "torch._dynamo was imported"
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_backend_first_resolved_inside_a_compiled_function_is_probed_eagerly(
    monkeypatch,
) -> None:
    """A probe traced by dynamo would compare traced values, not run its kernels."""
    compiling = []
    run_probe = select._run_probe

    def recording_probe(*args):
        compiling.append(torch.compiler.is_compiling())
        return run_probe(*args)

    monkeypatch.setattr(select, "_run_probe", recording_probe)

    def pick(x):
        return x + 1 if select.resolve_attn_impl("auto", "cpu") == "sdpa" else x

    assert torch.equal(torch.compile(pick, backend="eager")(torch.zeros(2)), torch.ones(2))
    assert compiling == [False], compiling  # sdpa's forward+backward probe, once, eagerly
    torch._dynamo.reset()
