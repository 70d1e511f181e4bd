"""Which attention backend runs: `auto` takes only a backend whose start-up probe passed.

A backend being installed says little: torch's `varlen_attn` changed its keywords between
releases and FlexAttention has no CPU backward. So before `auto` picks a backend for a
(device, dtype) it runs the backend's forward and backward once on tiny packed inputs and
compares both with a float32 dense reference; the first backend in `auto_order(device)` that
passes is chosen, and the choice and every rejection are logged. Results are cached per process.

The order is measured per kind of device (bench/RESULTS.md). On CUDA (H200, torch 2.11,
nedolm-0.8b at 4x4096) compiled torch_varlen and flex train within 1% of each other (88.5k and
89.3k tokens/s) and sdpa at 73k; eager, flex takes 2.8 GiB more memory, so torch_varlen stays
ahead of flex. Elsewhere flex comes last, after sdpa: on a CPU FlexAttention runs as eager dense
math (inductor fails to compile it on torch 2.10), and on torch 2.10, whose flex has a CPU
backward, `auto` picked it and the demo's model trained 7x slower than with sdpa.
"""

# Shape legend: T probe tokens, H query heads, G kv heads, K head dim.
from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable

import torch
from torch import Tensor

from nedolm.model.attention import (
    BACKENDS,
    AttentionBackendError,
    attention_backends,
    build_layout,
    set_varlen_native_gqa,
    varlen_attention,
    varlen_gqa_mode,
)

log = logging.getLogger(__name__)

_PROBE_LENGTHS = (5, 1, 19, 7)  # one single-token segment; T = 32
_PROBE_HEADS, _PROBE_KV_HEADS, _PROBE_HEAD_DIM = 4, 2, 64  # GQA 2:1
_HALF_TOLERANCE, _FLOAT_TOLERANCE = 2e-2, 1e-3  # relative L2 error vs the fp32 reference


_probed: dict[tuple[str, torch.device, torch.dtype, bool], str | None] = {}
_resolved: dict[tuple[str, torch.device, torch.dtype], str] = {}


def resolve_attn_impl(
    attn_impl: str,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    *,
    backward: bool = True,
) -> str:
    """The backend that runs `attn_impl` on `device` with `dtype` inputs.

    `auto` is the first backend (in `auto_order(device)`) whose forward+backward probe passed. A
    named backend must be present and pass its forward probe, and with `backward` (the default:
    training) its forward+backward probe. `dtype` defaults to bf16 on CUDA, else float32 (the
    trainer passes its own: fp32 on a GPU without bf16 tensor cores). Cached: with
    `backward=False` (what the model's forward asks) a repeated call is one dict look-up, which
    compiled graphs trace without a break.

    Raises:
        AttentionBackendError: unknown name, or the backend cannot run here (with the reason).
    """
    device, dtype = _normalize(device, dtype)
    name = _resolved.get((attn_impl, device, dtype))
    if name is None or (backward and attn_impl != "auto"):
        name = _eager_resolver()(attn_impl, device, dtype, backward)
    return name


def _eager_resolver() -> Callable[[str, torch.device, torch.dtype, bool], str]:
    """``_resolve_uncached``, kept out of any compiled trace: probes run their kernels even when
    first reached from a compiled forward. Wrapped only then, not at import:
    ``torch.compiler.disable`` imports torch._dynamo, a second of the start-up of every process
    that never compiles (``generate``, ``chat``, ``export``)."""
    if torch.compiler.is_compiling():
        return torch.compiler.disable(_resolve_uncached)
    return _resolve_uncached


def auto_order(device: torch.device | str) -> tuple[str, ...]:
    """The backends `auto` tries on `device`, best first: `BACKENDS` on CUDA, flex last
    elsewhere (see the module docstring for the measurements)."""
    if torch.device(device).type == "cuda":
        return BACKENDS
    return (*(name for name in BACKENDS if name != "flex"), "flex")


def probe_backends(
    device: torch.device | str, dtype: torch.dtype | None = None
) -> dict[str, str | None]:
    """Every backend mapped to None when it trains on `device` in `dtype`, else why not."""
    device, dtype = _normalize(device, dtype)
    return {name: _why_not_trainable(name, device, dtype) for name in BACKENDS}


def probe(name: str, device: torch.device, dtype: torch.dtype, *, backward: bool) -> str | None:
    """Why `name` failed on tiny packed inputs (None: it passed); run once per process.

    With `backward` the forward runs under autograd and its input gradients are checked too;
    without, the forward runs under no_grad (FlexAttention on CPU runs only so).
    """
    key = (name, device, dtype, backward)
    if key not in _probed:
        _probed[key] = _run_probe(name, device, dtype, backward)
    return _probed[key]


def _normalize(
    device: torch.device | str, dtype: torch.dtype | None
) -> tuple[torch.device, torch.dtype]:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, dtype


def _resolve_uncached(
    attn_impl: str, device: torch.device, dtype: torch.dtype, backward: bool
) -> str:
    if attn_impl == "auto":
        name = _choose(device, dtype)
    elif attn_impl not in BACKENDS:
        raise AttentionBackendError(
            f"unknown attn_impl {attn_impl!r}; choose one of {('auto', *BACKENDS)}"
        )
    else:
        name = attn_impl
        reason = attention_backends(device)[name]
        if reason is None and (why := probe(name, device, dtype, backward=False)) is not None:
            reason = f"its start-up forward probe failed ({device}, {dtype}): {why}"
        if reason is not None:
            raise AttentionBackendError(f"attn_impl={name!r} cannot run here: {reason}")
        if backward and (why := probe(name, device, dtype, backward=True)) is not None:
            raise AttentionBackendError(
                f"attn_impl={name!r} cannot train on {device} in {dtype}: its start-up "
                f"forward+backward probe failed: {why}"
            )
    _resolved[(attn_impl, device, dtype)] = name
    return name


def _choose(device: torch.device, dtype: torch.dtype) -> str:
    rejected = []
    for name in auto_order(device):
        why_not = _why_not_trainable(name, device, dtype)
        if why_not is None:
            detail = "; ".join(rejected) or "nothing preferred was rejected"
            log.info("attn_impl auto: %s on %s in %s (%s)", name, device, dtype, detail)
            return name
        rejected.append(f"{name}: {why_not}")
    raise AttentionBackendError(
        f"no attention backend trains on {device} in {dtype}: " + "; ".join(rejected)
    )


def _why_not_trainable(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    reason = attention_backends(device)[name]
    if reason is None and (why := probe(name, device, dtype, backward=True)) is not None:
        reason = f"forward+backward probe failed: {why}"
    return reason


def _run_probe(name: str, device: torch.device, dtype: torch.dtype, backward: bool) -> str | None:
    unproven_gqa = name == "torch_varlen" and varlen_gqa_mode() == "unproven"
    if unproven_gqa and _decide_varlen_gqa(device, dtype) is None:
        return None  # that was this probe, forward and backward, and it passed
    return _compare_with_reference(name, device, dtype, backward)


def _decide_varlen_gqa(device: torch.device, dtype: torch.dtype) -> str | None:
    """Pass torch 2.10/2.11's `varlen_attn` unexpanded KV heads only if that passes the probe.

    Their flash kernel groups query heads over fewer KV heads by itself, which saves a copy of
    K and V per query head in every layer's forward and its sum in the backward; their API
    promises nothing about it (2.12 added `enable_gqa`), so output and gradients are checked
    against the reference that way once per process, and a kernel that fails gets copies.
    Returns why the unexpanded probe failed (None: it passed).
    """
    set_varlen_native_gqa(True)
    why = _compare_with_reference("torch_varlen", device, dtype, backward=True)
    set_varlen_native_gqa(why is None)
    if why is None:
        log.info("torch_varlen: varlen_attn takes grouped KV heads unexpanded (probe passed)")
    else:
        log.info("torch_varlen: KV heads copied per query head; unexpanded probe failed: %s", why)
    return why


def _compare_with_reference(
    name: str, device: torch.device, dtype: torch.dtype, backward: bool
) -> str | None:
    gen = torch.Generator().manual_seed(0)
    T = sum(_PROBE_LENGTHS)
    shapes = ((T, _PROBE_HEADS, _PROBE_HEAD_DIM), *[(T, _PROBE_KV_HEADS, _PROBE_HEAD_DIM)] * 2)
    exact = [torch.randn(shape, generator=gen) for shape in shapes]
    grad_THK = torch.randn(shapes[0], generator=gen)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(_PROBE_LENGTHS)], dtype=torch.int32)
    tolerance = _HALF_TOLERANCE if dtype in (torch.float16, torch.bfloat16) else _FLOAT_TOLERANCE
    # Outside any autocast, inference mode or grad mode a caller may be in.
    with (
        torch.inference_mode(False),
        torch.autocast(device.type, enabled=False),
        torch.set_grad_enabled(backward),
    ):
        want = _reference(*exact, grad_THK)
        inputs = [t.to(device, dtype).requires_grad_(backward) for t in exact]
        try:
            layout = build_layout(name, cu_seqlens.to(device), None, T)
            out = varlen_attention(*inputs, layout)
            grads = torch.autograd.grad(out, inputs, grad_THK.to(device, dtype)) if backward else ()
            got = (out, *grads)
        except Exception as error:  # any failure rejects the backend; the reason is kept
            return _describe(error)
    names = ("output", "d query", "d key", "d value")
    mismatches = (_mismatch(*case, tolerance) for case in zip(names, got, want, strict=False))
    return next((m for m in mismatches if m is not None), None)


def _reference(q_THK: Tensor, k_TGK: Tensor, v_TGK: Tensor, grad_THK: Tensor) -> tuple[Tensor, ...]:
    """Float32 dense masked softmax over all T probe tokens, and its input gradients."""
    T, H, K = q_THK.shape
    lengths = torch.tensor(_PROBE_LENGTHS)
    segment_T = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    allowed_TT = (segment_T[:, None] == segment_T[None, :]) & torch.ones(T, T).tril().bool()
    inputs = [t.clone().requires_grad_() for t in (q_THK, k_TGK, v_TGK)]
    n_rep = H // k_TGK.size(1)
    with torch.enable_grad():
        q, k, v = (t.transpose(0, 1) for t in inputs)
        k, v = k.repeat_interleave(n_rep, dim=0), v.repeat_interleave(n_rep, dim=0)
        scores = (q @ k.transpose(1, 2) / math.sqrt(K)).masked_fill(~allowed_TT, float("-inf"))
        out_THK = (scores.softmax(-1) @ v).transpose(0, 1)
        grads = torch.autograd.grad(out_THK, inputs, grad_THK)
    return (out_THK.detach(), *grads)


def _mismatch(what: str, got: Tensor, want: Tensor, tolerance: float) -> str | None:
    error = float((got.detach().float().cpu() - want).norm() / want.norm())
    if not math.isfinite(error) or error > tolerance:
        return f"{what} differs from the float32 reference by {error:.2e} (relative L2)"
    return None


def _describe(error: Exception) -> str:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first_line}"
