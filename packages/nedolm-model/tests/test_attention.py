import inspect
import itertools
import math
from typing import ClassVar

import pytest
import torch

from nedolm.model import AttentionBackendError, attention_backends, resolve_attn_impl
from nedolm.model.attention import _padded_length, build_layout, varlen_attention

AVAILABLE = [name for name, why_not in attention_backends().items() if why_not is None]
ON_CPU = [name for name, why_not in attention_backends("cpu").items() if why_not is None]


def device_of(backend: str) -> str:
    return "cpu" if backend in ON_CPU else "cuda"


def naive_segment_attention(q, k, v, cu_seqlens):
    """Float64 softmax(q k^T / sqrt(K) + causal mask) v, one segment at a time."""
    n_rep = q.size(1) // k.size(1)
    out = torch.empty_like(q, dtype=torch.float64)
    bounds = cu_seqlens.tolist()
    for start, end in itertools.pairwise(bounds):
        qs = q[start:end].double().transpose(0, 1)
        ks = k[start:end].double().repeat_interleave(n_rep, dim=1).transpose(0, 1)
        vs = v[start:end].double().repeat_interleave(n_rep, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) / math.sqrt(q.size(-1))
        future = torch.ones(end - start, end - start, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        out[start:end] = (probs @ vs).transpose(0, 1)
    return out


@pytest.mark.parametrize(
    "lengths",
    [[5, 1, 9, 30, 2, 7, 7, 100], [16, 16, 16], [1], [33, 17, 18, 1, 1, 64]],
)
def test_grouped_sdpa_matches_naive_per_segment_attention(lengths: list[int]) -> None:
    torch.manual_seed(0)
    total = sum(lengths)
    q, k, v = torch.randn(total, 4, 8), torch.randn(total, 2, 8), torch.randn(total, 2, 8)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = varlen_attention(q, k, v, build_layout("sdpa", cu_seqlens, None, total))
    want = naive_segment_attention(q, k, v, cu_seqlens)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_padded_lengths_are_few_and_cheap() -> None:
    for length in range(1, 5000):
        padded = _padded_length(length)
        assert length <= padded <= max(16, math.ceil(length * 1.125))
    assert len({_padded_length(n) for n in range(1, 4097)}) <= 80


def packed_row_and_documents(vocab: int, lengths: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, vocab, (n,), generator=gen) for n in lengths]
    return torch.cat(docs)[None, :], docs


def run_packed(model, row, lengths):
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None, :]
    _, logits = model(row, cu_seqlens=bounds, max_seqlen=max(lengths), position_ids=positions)
    return logits[0].split(lengths)


@pytest.mark.parametrize("backend", AVAILABLE)
@pytest.mark.parametrize("dispatch", ["masked", "sparse", "grouped"])
def test_packed_row_equals_each_conversation_alone(make_model, backend: str, dispatch: str) -> None:
    device = device_of(backend)
    model = make_model(attn_impl=backend, morph_dispatch=dispatch).to(device).eval()
    lengths = [5, 1, 9, 23, 9, 17]
    row, docs = packed_row_and_documents(model.cfg.vocab_size, lengths, seed=1)
    half = device == "cuda"  # the CUDA kernels are half-only
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=half):
        packed = run_packed(model, row.to(device), lengths)
        for doc, got in zip(docs, packed, strict=True):
            _, alone = model(doc[None, :].to(device))
            tol = dict(atol=2e-2, rtol=2e-2) if half else dict(atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got, alone[0], **tol)


@pytest.mark.parametrize("backend", AVAILABLE)
def test_no_information_crosses_an_eos_boundary(make_model, backend: str) -> None:
    device = device_of(backend)
    model = make_model(attn_impl=backend).to(device).eval()
    lengths = [12, 7, 20, 3]
    row, _ = packed_row_and_documents(model.cfg.vocab_size, lengths, seed=2)
    perturbed = row.clone()
    perturbed[0, 12:19] = torch.randint(3, model.cfg.vocab_size, (7,))  # the second conversation
    assert not perturbed.equal(row)
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        before = run_packed(model, row.to(device), lengths)
        after = run_packed(model, perturbed.to(device), lengths)
    for index in (0, 2, 3):
        assert torch.equal(before[index], after[index])
    assert not torch.equal(before[1], after[1])


def test_unavailable_backends_are_refused_with_the_reason(make_model) -> None:
    for name, why_not in attention_backends("cpu").items():
        if why_not is None:
            assert resolve_attn_impl(name, "cpu", backward=False) == name
            continue
        with pytest.raises(AttentionBackendError, match=name):
            resolve_attn_impl(name, "cpu")
    with pytest.raises(AttentionBackendError, match="unknown attn_impl 'flesh'"):
        resolve_attn_impl("flesh", "cpu")
    model = make_model(attn_impl="torch_varlen")
    with pytest.raises(AttentionBackendError, match="needs a CUDA device"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_inconsistent_layouts_are_refused(make_model) -> None:
    model = make_model()
    input_ids = torch.randint(0, model.cfg.vocab_size, (2, 8))
    for bad in ([0, 5, 12], [1, 8, 16], [0, 8, 8, 16]):
        with pytest.raises(ValueError, match="token count 16"):
            model(input_ids, cu_seqlens=torch.tensor(bad, dtype=torch.int32))
    with pytest.raises(ValueError, match="labels shape"):
        model(input_ids, input_ids[:, :4])
    with pytest.raises(ValueError, match="position_ids shape"):
        model(input_ids, position_ids=torch.arange(8))


def reference_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
):
    """flash-attn's documented contract, computed naively (flash-attn cannot run on CPU)."""
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and cu_seqlens_q.dtype == torch.int32
    assert max_seqlen_q == max_seqlen_k == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    assert causal and dropout_p == 0.0 and softmax_scale is None
    return naive_segment_attention(q, k, v, cu_seqlens_q).to(q.dtype)


def test_flash_backend_calls_its_kernel_per_its_contract(monkeypatch) -> None:
    """CPU coverage of the flash adapter's wiring; the kernel itself runs in bench/gpu.sh."""
    from nedolm.model import attention

    real = attention.flash_attn_varlen_func
    if real is not None:  # the real kernel takes the keywords the reference is called with
        names = set(inspect.signature(real).parameters)
        assert set(inspect.signature(reference_flash_attn_varlen_func).parameters) <= names
    monkeypatch.setattr(attention, "flash_attn_varlen_func", reference_flash_attn_varlen_func)
    torch.manual_seed(0)
    lengths = [5, 1, 9, 30]
    q, k, v = torch.randn(45, 4, 8), torch.randn(45, 2, 8), torch.randn(45, 2, 8)
    cu_seqlens = torch.tensor([0, 5, 6, 15, 45])
    layout = build_layout("flash", cu_seqlens, None, sum(lengths))
    with pytest.raises(AttentionBackendError, match="needs bf16/fp16"):
        varlen_attention(q, k, v, layout)
    half = [t.bfloat16() for t in (q, k, v)]
    want = varlen_attention(*half, build_layout("sdpa", cu_seqlens, None, sum(lengths)))
    torch.testing.assert_close(varlen_attention(*half, layout), want, atol=2e-2, rtol=2e-2)


def varlen_kernel_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
    """What every torch's varlen_attn computes, causal, naively; fewer KV heads are grouped."""
    assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32
    assert max_q == max_k == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    return naive_segment_attention(query, key, value, cu_seq_q).to(query.dtype)


# The public signatures, parameter for parameter, of torch/nn/attention/varlen.py in the
# torch 2.10.0, 2.11.0 and 2.12.0 wheels (2.12.1, 2.13.0 and 2.14.1 are the same as 2.12.0).
def varlen_attn_torch_2_10(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None
):
    assert is_causal and return_aux is None
    return varlen_kernel_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)


def varlen_attn_torch_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
    window_size=(-1, -1),
):  # fmt: skip
    assert window_size == (-1, 0), "(-1, 0) is varlen_attn's causal mask"
    assert return_aux is None and scale is None
    return varlen_kernel_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)


def varlen_attn_torch_2_12(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
):  # fmt: skip
    assert window_size == (-1, 0), "(-1, 0) is varlen_attn's causal mask"
    assert return_aux is scale is seqused_k is block_table is num_splits is None
    if not enable_gqa and query.size(1) != key.size(1):  # torch 2.12's own check
        raise ValueError("Expect query and key/value to have the same number of heads")
    return varlen_kernel_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)


def test_the_installed_torchs_varlen_attn_has_one_of_the_signatures_handled() -> None:
    from torch.nn.attention.varlen import varlen_attn  # importable without CUDA

    def parameters(fn) -> list[tuple[str, object]]:
        return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]

    stand_ins = (varlen_attn_torch_2_10, varlen_attn_torch_2_11, varlen_attn_torch_2_12)
    assert parameters(varlen_attn) in [parameters(fn) for fn in stand_ins]


@pytest.mark.parametrize(
    "stand_in", [varlen_attn_torch_2_10, varlen_attn_torch_2_11, varlen_attn_torch_2_12]
)
def test_torch_varlen_calls_each_torchs_varlen_attn_correctly(monkeypatch, stand_in) -> None:
    """Output and gradients through each release's varlen_attn equal sdpa's (bf16 inputs)."""
    from nedolm.model import attention

    monkeypatch.setattr(attention, "varlen_attn", stand_in)
    torch.manual_seed(0)
    lengths = [5, 1, 9, 30]
    cu_seqlens = torch.tensor([0, 5, 6, 15, 45])
    exact = [torch.randn(45, heads, 8) for heads in (6, 2, 2)]  # GQA 3:1
    layout = build_layout("torch_varlen", cu_seqlens, None, sum(lengths))
    with pytest.raises(AttentionBackendError, match="needs bf16/fp16"):
        varlen_attention(*exact, layout)
    grad = torch.randn(45, 6, 8, dtype=torch.bfloat16)
    results = []
    for impl_layout in (layout, build_layout("sdpa", cu_seqlens, None, sum(lengths))):
        inputs = [t.bfloat16().requires_grad_() for t in exact]
        out = varlen_attention(*inputs, impl_layout)
        results.append((out, *torch.autograd.grad(out, inputs, grad)))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("lengths", [[5, 1, 9, 30, 2, 7, 7, 100], [16, 16, 16]])
def test_sdpa_op_for_compiled_graphs_matches_eager_in_value_and_gradient(lengths) -> None:
    from nedolm.model.attention import sdpa_varlen_op

    torch.manual_seed(0)
    total = sum(lengths)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inputs = [torch.randn(total, heads, 8, requires_grad=True) for heads in (4, 2, 2)]
    torch.library.opcheck(sdpa_varlen_op, (*inputs, cu_seqlens))
    grad = torch.randn(total, 4, 8)
    eager = varlen_attention(*inputs, build_layout("sdpa", cu_seqlens, None, total))
    want = torch.autograd.grad(eager, inputs, grad)
    op_out = sdpa_varlen_op(*inputs, cu_seqlens)
    got = torch.autograd.grad(op_out, inputs, grad)
    torch.testing.assert_close(op_out, eager)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_sdpa_op_backward_runs_sdpas_own_kernels_in_the_input_dtype() -> None:
    """The compiled path's backward is eager autograd's, bit for bit, even in bf16.

    (A float32 closed form, as before, rounds differently from SDPA's bf16 kernels.)
    """
    from nedolm.model.attention import sdpa_varlen_op

    torch.manual_seed(0)
    lengths = [5, 1, 9, 30, 2, 7, 7, 100]
    total = sum(lengths)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inputs = [torch.randn(total, heads, 8).bfloat16().requires_grad_() for heads in (4, 2, 2)]
    grad = torch.randn(total, 4, 8).bfloat16()
    eager = varlen_attention(*inputs, build_layout("sdpa", cu_seqlens, None, total))
    want = torch.autograd.grad(eager, inputs, grad)
    got = torch.autograd.grad(sdpa_varlen_op(*inputs, cu_seqlens), inputs, grad)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        assert torch.equal(g, w)


def test_sdpa_plan_reads_host_offsets_and_puts_its_indices_on_the_attention_device() -> None:
    """Compiled graphs hand the op a CPU copy of cu_seqlens (see the host-copy tests), so its
    per-layer planning never reads the device; the indices go where q lives."""
    from nedolm.model.attention import sdpa_plan

    cu_seqlens = torch.tensor([0, 5, 6, 15, 45], dtype=torch.int32)
    groups, inverse, longest = sdpa_plan(cu_seqlens, 45, torch.device("meta"))
    assert longest == 30 and inverse is not None and inverse.device.type == "meta"
    assert all(isinstance(g, torch.Tensor) and g.device.type == "meta" for g in groups)


_HOST_READS = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.__int__}


class DeviceOffsets(torch.Tensor):
    """cu_seqlens standing for a GPU tensor: notes each read that would wait for the device."""

    reads: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            cls.reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("compiled", [False, True])
def test_sdpa_plans_from_a_host_copy_without_reading_the_device(compiled: bool) -> None:
    """The trainer builds cu_seqlens on the CPU: given that copy, sdpa's plan (eager) or its
    op's input (compiled) comes from it, and the device tensor is never read."""
    host = torch.tensor([0, 5, 6, 15, 45], dtype=torch.int32)
    device_copy = host.clone().as_subclass(DeviceOffsets)
    DeviceOffsets.reads = []
    got = build_layout("sdpa", device_copy, 30, 45, compiled=compiled, host_cu_seqlens=host)
    assert DeviceOffsets.reads == []
    want = build_layout("sdpa", host, 30, 45, compiled=compiled)
    assert got.max_seqlen == want.max_seqlen and len(got.groups) == len(want.groups)
    assert all(torch.equal(g, w) for g, w in zip(got.groups, want.groups, strict=True))
    if compiled:
        assert type(got.cu_seqlens) is torch.Tensor and torch.equal(got.cu_seqlens, host)
    else:
        assert torch.equal(got.inverse, want.inverse)
    build_layout("sdpa", device_copy, 30, 45, compiled=compiled)  # no copy: the device is read
    assert DeviceOffsets.reads


def test_kernel_backends_find_the_longest_segment_in_the_host_copy() -> None:
    """Without `max_seqlen`, flash and torch_varlen size their grid from the host copy."""
    host = torch.tensor([0, 5, 6, 15, 45], dtype=torch.int32)
    device_copy = host.clone().as_subclass(DeviceOffsets)
    DeviceOffsets.reads = []
    layout = build_layout("torch_varlen", device_copy, None, 45, host_cu_seqlens=host)
    assert layout.max_seqlen == 30 and layout.cu_seqlens is not host
    assert DeviceOffsets.reads == []


def test_the_model_hands_sdpa_the_host_copy(make_model) -> None:
    model = make_model(attn_impl="sdpa").eval()
    lengths = [5, 1, 9, 23]
    row, _ = packed_row_and_documents(model.cfg.vocab_size, lengths, seed=3)
    host = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None, :]
    DeviceOffsets.reads = []
    with torch.no_grad():
        _, want = model(row, cu_seqlens=host, max_seqlen=23, position_ids=positions)
        _, got = model(
            row,
            cu_seqlens=host.clone().as_subclass(DeviceOffsets),
            max_seqlen=23,
            position_ids=positions,
            host_cu_seqlens=host,
        )
    assert DeviceOffsets.reads == []
    torch.testing.assert_close(got.as_subclass(torch.Tensor), want, rtol=0, atol=0)
