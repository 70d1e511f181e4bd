"""Causal attention over packed segments: the flash, torch_varlen, flex and sdpa backends.

Every backend attends only inside the segments given by `cu_seqlens`, so packed conversations
never see each other. `flash`, `torch_varlen` and `flex` make one call per layer over the whole
micro-batch (`flex` with a document block mask built once per forward, see `nedolm.model.flex`).
`sdpa` is the reference that runs anywhere; it batches segments of similar length into one
`scaled_dot_product_attention` call each, padding a segment at its end. Causality makes that
padding exact: a real query never attends a later (padded) key. Under torch.compile the same
computation runs as the custom op `nedolm::sdpa_varlen`, so compiled graphs never depend on how
rows were packed. Which backend `auto` means is decided by `nedolm.model.attn_select`.
Optional kernels are imported only here.
"""

# Shape legend: T packed tokens, H query heads, G kv heads, K head dim, N segments,
# n segments in one sdpa group, P padded length of that group.
from __future__ import annotations

import importlib.util
import inspect
import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from nedolm.model.flex import document_block_mask, flex_varlen
from nedolm.model.layout import host_to_device

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:  # CPU installs and machines without the optional kernel
    flash_attn_varlen_func = None

# torch's varlen kernel runs only on CUDA, and importing it pulls in torch._dynamo (seconds at
# every process start), so CPU-only processes just check that it exists.
HAS_TORCH_VARLEN = importlib.util.find_spec("torch.nn.attention.varlen") is not None  # torch>=2.10
varlen_attn = None
if HAS_TORCH_VARLEN and torch.cuda.is_available():
    from torch.nn.attention.varlen import varlen_attn
_varlen_parameters: dict[Any, frozenset[str]] = {}  # per varlen_attn: its parameter names
_varlen_native_gqa: dict[Any, bool] = {}  # per varlen_attn without enable_gqa: probe's verdict

BACKENDS = ("flash", "torch_varlen", "flex", "sdpa")  # auto's order on CUDA (attn_select)
_HALF_DTYPES = (torch.float16, torch.bfloat16)


class AttentionBackendError(RuntimeError):
    """The requested attention backend cannot run here (or on these inputs)."""


def attention_backends(device: torch.device | str | None = None) -> dict[str, str | None]:
    """Each backend mapped to None when it is present for `device`, else the reason it is not.

    Present is not proven: `nedolm.model.attn_select` probes a present backend before `auto`
    picks it. `device` defaults to CUDA when present, else CPU.
    """
    device = torch.device(device if device is not None else _default_device())
    on_cuda = device.type == "cuda" and torch.cuda.is_available()
    flash: str | None = None
    if flash_attn_varlen_func is None:
        flash = "flash-attn is not installed (pip install 'nedolm-model[flash]')"
    elif not on_cuda:
        flash = f"flash-attn needs a CUDA device, got {device.type}"
    torch_varlen: str | None = None
    if not HAS_TORCH_VARLEN:
        torch_varlen = f"torch.nn.attention.varlen is missing in torch {torch.__version__}"
    elif not on_cuda:
        torch_varlen = f"torch.nn.attention.varlen needs a CUDA device, got {device.type}"
    return {"flash": flash, "torch_varlen": torch_varlen, "flex": None, "sdpa": None}


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class VarlenLayout:
    """Everything a backend needs to isolate segments; built once per forward, shared by blocks.

    For eager `sdpa`, `groups` holds [n, P] token indices per padded length (or, when every
    segment has the same length L, just the int L: a reshape instead of a gather) and `inverse`
    [T] maps each token to its row in the concatenated group outputs (None when that is already
    token order). For compiled blocks both stay empty and the `nedolm::sdpa_varlen` op plans
    inside itself, so compiled graphs do not depend on how rows were packed (no recompiles from
    batch to batch); `cu_seqlens` is then a CPU copy (the caller's, else read from the device
    once per forward), so no layer waits for the device to plan. `flex` keeps its document
    block mask in `block_mask`.
    """

    impl: str
    cu_seqlens: Tensor
    max_seqlen: int
    groups: list[Tensor | int]
    inverse: Tensor | None
    block_mask: BlockMask | None = None


def build_layout(
    impl: str,
    cu_seqlens: Tensor,
    max_seqlen: int | None,
    n_tokens: int,
    *,
    compiled: bool = False,
    host_cu_seqlens: Tensor | None = None,
) -> VarlenLayout:
    """Precompute a backend's view of the segments (the sdpa plan needs the lengths on host).

    `compiled`: the blocks run compiled (or this runs inside torch.compile), so sdpa leaves the
    plan to its op: a graph must not depend on how the rows were packed.
    `host_cu_seqlens`: a CPU copy of `cu_seqlens` (the caller built it there): sdpa plans from
    it instead of reading the device, which on a GPU waits for all the work queued before.

    Raises:
        ValueError: (sdpa, which reads the offsets anyway) cu_seqlens does not split
            [0, n_tokens) into non-empty segments.
    """
    cu_seqlens = cu_seqlens.to(torch.int32)
    if impl == "flex":  # the mask needs no host read
        mask = document_block_mask(cu_seqlens, n_tokens)
        return VarlenLayout(impl, cu_seqlens, max_seqlen or 0, [], None, mask)
    if impl == "sdpa" and (compiled or torch.compiler.is_compiling()):
        host_cu = cu_seqlens.cpu() if host_cu_seqlens is None else host_cu_seqlens.to(torch.int32)
        if not torch.compiler.is_compiling():  # a compiled block's input: any segment count
            torch._dynamo.maybe_mark_dynamic(host_cu, 0)
        return VarlenLayout(impl, host_cu, max_seqlen or 0, [], None)
    offsets = cu_seqlens if host_cu_seqlens is None else host_cu_seqlens  # read on the host
    if impl != "sdpa":
        if max_seqlen is None:
            max_seqlen = int((offsets[1:] - offsets[:-1]).max())
        return VarlenLayout(impl, cu_seqlens, max_seqlen, [], None)
    groups, inverse, max_len = sdpa_plan(offsets, n_tokens, cu_seqlens.device)
    return VarlenLayout(impl, cu_seqlens, max_len, groups, inverse)


def sdpa_plan(
    cu_seqlens: Tensor, n_tokens: int, device: torch.device
) -> tuple[list[Tensor | int], Tensor | None, int]:
    """Group segments by padded length: (index per group, inverse permutation, longest), the
    index tensors on `device`, copied from pinned memory without waiting on a CUDA device."""
    bounds = cu_seqlens.tolist()
    starts, lengths = bounds[:-1], [e - s for s, e in itertools.pairwise(bounds)]
    if bounds[0] != 0 or bounds[-1] != n_tokens or min(lengths, default=0) <= 0:
        raise ValueError(
            f"cu_seqlens must rise strictly from 0 to the token count {n_tokens}, "
            f"got {len(bounds)} offsets {bounds[:4]}...{bounds[-2:]}"
        )
    if len(set(lengths)) == 1:
        return [lengths[0]], None, lengths[0]
    by_padded: dict[int, list[int]] = {}
    for seg, length in enumerate(lengths):
        by_padded.setdefault(_padded_length(length), []).append(seg)
    inverse_T = torch.empty(n_tokens, dtype=torch.long)
    groups: list[Tensor | int] = []
    offset = 0
    for padded, segs in sorted(by_padded.items()):
        start_n = torch.tensor([starts[s] for s in segs])
        length_n = torch.tensor([lengths[s] for s in segs])
        cols_P = torch.arange(padded)
        # Padding repeats the segment's last token: finite values that no real query sees.
        index_nP = start_n[:, None] + torch.minimum(cols_P[None, :], length_n[:, None] - 1)
        real_nP = cols_P[None, :] < length_n[:, None]
        rows_nP = offset + torch.arange(len(segs) * padded).view(len(segs), padded)
        inverse_T[index_nP[real_nP]] = rows_nP[real_nP]
        groups.append(host_to_device(index_nP, device))
        offset += len(segs) * padded
    return groups, host_to_device(inverse_T, device), max(lengths)


def _padded_length(length: int) -> int:
    """Round up by at most 1/8 (and to >= 16) so few distinct shapes cover all lengths."""
    granule = 1 << max(0, length.bit_length() - 4)
    return max(16, -(-length // granule) * granule)


def varlen_attention(q_THK: Tensor, k_TGK: Tensor, v_TGK: Tensor, layout: VarlenLayout) -> Tensor:
    """Causal attention of each token over the earlier tokens of its own segment."""
    if layout.impl == "sdpa":
        if not layout.groups:  # planned inside the op (compiled graphs)
            return sdpa_varlen_op(q_THK, k_TGK, v_TGK, layout.cu_seqlens)
        return _sdpa_grouped(q_THK, k_TGK, v_TGK, layout.groups, layout.inverse)
    if layout.impl == "flex":
        if layout.block_mask is None:
            raise AttentionBackendError("attn_impl='flex' needs the layout's block mask")
        return flex_varlen(q_THK, k_TGK, v_TGK, layout.block_mask)
    if q_THK.dtype not in _HALF_DTYPES:
        raise AttentionBackendError(
            f"attn_impl={layout.impl!r} needs bf16/fp16 inputs (use autocast), got {q_THK.dtype}"
        )
    cu, max_len = layout.cu_seqlens, layout.max_seqlen
    if layout.impl == "flash":
        return flash_attn_varlen_func(q_THK, k_TGK, v_TGK, cu, cu, max_len, max_len, causal=True)
    return _torch_varlen(q_THK, k_TGK, v_TGK, cu, max_len)


def _torch_varlen(q_THK: Tensor, k_TGK: Tensor, v_TGK: Tensor, cu: Tensor, max_len: int) -> Tensor:
    """Call `varlen_attn` the way the installed torch spells it.

    torch 2.10: `is_causal=`; 2.11: `window_size=(-1, 0)`; 2.12+: `window_size` and
    `enable_gqa=`. See `varlen_gqa_mode` for how fewer KV heads than query heads are passed.
    """
    params = _varlen_keywords()
    if "enable_gqa" in params:
        return varlen_attn(
            q_THK, k_TGK, v_TGK, cu, cu, max_len, max_len, window_size=(-1, 0), enable_gqa=True
        )
    n_rep = q_THK.size(1) // k_TGK.size(1)
    if n_rep > 1 and not _varlen_native_gqa.get(varlen_attn, False):
        k_TGK, v_TGK = (t.repeat_interleave(n_rep, dim=1) for t in (k_TGK, v_TGK))
    causal: dict[str, Any] = (
        {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    )
    return varlen_attn(q_THK, k_TGK, v_TGK, cu, cu, max_len, max_len, **causal)


def varlen_gqa_mode() -> str:
    """How `torch_varlen` gives the installed `varlen_attn` fewer KV heads than query heads.

    "keyword": `enable_gqa=True` (torch 2.12+). Older releases have no such keyword, though
    their flash kernel groups heads itself; so the KV heads are passed as they are ("native")
    only once `nedolm.model.attn_select`'s probe has shown that this kernel's output and
    gradients match the reference that way (`set_varlen_native_gqa`). Until then, or when that
    probe failed, every query head gets its own copy of its KV head (query head h reads KV
    head h // n_rep, as SDPA's GQA does): "unproven" or "expanded". "absent" without the
    kernel (no CUDA, or torch < 2.10).
    """
    if varlen_attn is None:
        return "absent"
    if "enable_gqa" in _varlen_keywords():
        return "keyword"
    verdict = _varlen_native_gqa.get(varlen_attn)
    return "unproven" if verdict is None else "native" if verdict else "expanded"


def set_varlen_native_gqa(native: bool) -> None:
    """Record whether the installed `varlen_attn` is to get unexpanded KV heads."""
    _varlen_native_gqa[varlen_attn] = native


def _varlen_keywords() -> frozenset[str]:
    """`varlen_attn`'s parameter names, read once per kernel (inspect costs ~50 us a call)."""
    names = _varlen_parameters.get(varlen_attn)
    if names is None:
        names = _varlen_parameters[varlen_attn] = frozenset(
            inspect.signature(varlen_attn).parameters
        )
    return names


def _sdpa_grouped(
    q_THK: Tensor,
    k_TGK: Tensor,
    v_TGK: Tensor,
    groups: list[Tensor | int],
    inverse: Tensor | None,
) -> Tensor:
    T, H, K = q_THK.shape
    outputs = []
    for group in groups:
        if isinstance(group, int):  # equal segments of this length: reshape, no gather
            q, k, v = (t.view(T // group, group, -1, K) for t in (q_THK, k_TGK, v_TGK))
        else:
            q, k, v = (t[group] for t in (q_THK, k_TGK, v_TGK))
        outputs.append(causal_sdpa(q, k, v).reshape(-1, H, K))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return out if inverse is None else out[inverse]


@torch.library.custom_op("nedolm::sdpa_varlen", mutates_args=())
def sdpa_varlen_op(q_THK: Tensor, k_TGK: Tensor, v_TGK: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Grouped sdpa as one opaque op: plans from `cu_seqlens` inside, invisible to the compiler."""
    groups, inverse, _ = sdpa_plan(cu_seqlens, q_THK.size(0), q_THK.device)
    return _sdpa_grouped(q_THK, k_TGK, v_TGK, groups, inverse)


@sdpa_varlen_op.register_fake
def _(q_THK: Tensor, k_TGK: Tensor, v_TGK: Tensor, cu_seqlens: Tensor) -> Tensor:
    return torch.empty_like(q_THK)


@torch.library.custom_op("nedolm::sdpa_varlen_backward", mutates_args=())
def _sdpa_varlen_backward_op(
    grad_THK: Tensor, q_THK: Tensor, k_TGK: Tensor, v_TGK: Tensor, cu_seqlens: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention gradients by SDPA's own fused backward kernels, the forward recomputed.

    A custom op runs below autograd, so plain autograd records nothing here; functorch's vjp
    brings its own and differentiates the same grouped SDPA calls (and gathers) as eager mode.
    """
    groups, inverse, _ = sdpa_plan(cu_seqlens, q_THK.size(0), q_THK.device)
    _, pullback = torch.func.vjp(
        lambda q, k, v: _sdpa_grouped(q, k, v, groups, inverse), q_THK, k_TGK, v_TGK
    )
    return pullback(grad_THK)


@_sdpa_varlen_backward_op.register_fake
def _(grad_THK: Tensor, q_THK: Tensor, k_TGK: Tensor, v_TGK: Tensor, cu_seqlens: Tensor):
    return torch.empty_like(q_THK), torch.empty_like(k_TGK), torch.empty_like(v_TGK)


def _sdpa_varlen_setup(ctx: Any, inputs: tuple[Tensor, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _sdpa_varlen_grad(ctx: Any, grad_THK: Tensor) -> tuple[Tensor | None, ...]:
    q_THK, k_TGK, v_TGK, cu_seqlens = ctx.saved_tensors
    return (*_sdpa_varlen_backward_op(grad_THK, q_THK, k_TGK, v_TGK, cu_seqlens), None)


sdpa_varlen_op.register_autograd(_sdpa_varlen_grad, setup_context=_sdpa_varlen_setup)


def causal_sdpa(q_nPHK: Tensor, k_nPGK: Tensor, v_nPGK: Tensor) -> Tensor:
    """Batched causal SDPA on [n, P, heads, K] tensors, returns [n, P, H, K]."""
    q, k, v = (t.transpose(1, 2) for t in (q_nPHK, k_nPGK, v_nPGK))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
