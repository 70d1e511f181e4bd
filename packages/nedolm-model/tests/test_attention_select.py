"""`auto` takes only a backend whose start-up forward+backward probe passed, and says why."""

import logging

import pytest
import torch

from nedolm.model import AttentionBackendError, attention_backends, probe_backends
from nedolm.model import attn_select as select
from nedolm.model.attention import build_layout, varlen_attention


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
    assert "flex: forward+backward probe failed: NotImplementedError" in message
    reasons = probe_backends("cpu")
    assert reasons["sdpa"] is None
    assert "NotImplementedError" in reasons["flex"]
    assert reasons["flash"] == attention_backends("cpu")["flash"]


def test_a_named_backend_that_cannot_train_here_is_refused_for_training() -> None:
    with pytest.raises(AttentionBackendError, match=r"'flex' cannot train on cpu.*NotImplemented"):
        select.resolve_attn_impl("flex", "cpu")
    assert select.resolve_attn_impl("flex", "cpu", backward=False) == "flex"  # forward runs


def sdpa_computed(query, key, value, cu_seq_q):
    total = query.size(0)
    return varlen_attention(query, key, value, build_layout("sdpa", cu_seq_q, None, total))


def kernel_with_torch_2_11_signature(behaviour):
    calls = []

    def varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
        window_size=(-1, -1),
    ):  # fmt: skip
        calls.append(window_size)
        return behaviour(query, key, value, cu_seq_q)

    return varlen_attn, calls


def broken(query, key, value, cu_seq_q):
    raise RuntimeError("CUDA error: no kernel image is available for execution on the device")


def mixes_tokens_up(query, key, value, cu_seq_q):
    return sdpa_computed(query, key, value, cu_seq_q).flip(0)


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
    from nedolm.model import attention

    kernel, calls = kernel_with_torch_2_11_signature(behaviour)
    monkeypatch.setattr(attention, "varlen_attn", kernel)
    monkeypatch.setattr(
        select,
        "attention_backends",
        lambda device: {**attention_backends(device), "torch_varlen": None},
    )
    caplog.set_level(logging.INFO, logger="nedolm.model.attn_select")
    assert select.resolve_attn_impl("auto", "cpu", torch.bfloat16) == chosen
    probed = len(calls)
    assert probed >= 1 and set(calls) == {(-1, 0)}
    assert select.resolve_attn_impl("auto", "cpu", torch.bfloat16) == chosen
    assert len(calls) == probed, "probed once per device and dtype"
    if rejection is not None:
        assert rejection in caplog.records[-1].getMessage()
        with pytest.raises(AttentionBackendError, match="'torch_varlen' cannot run here"):
            select.resolve_attn_impl("torch_varlen", "cpu", torch.bfloat16)
