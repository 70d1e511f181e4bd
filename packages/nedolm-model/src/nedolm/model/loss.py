"""Assistant-only loss head: vocabulary projection and cross-entropy, chunked, targets only.

SFT trains a minority of positions, and at vocab 32k the [tokens, vocab] logits (plus their
gradient) dwarf everything else in a small model. The head therefore gathers the hidden states
of target positions only and walks them in chunks, computing each chunk's loss *and* its
gradients in the forward pass (the softmax is needed for both): no chunk's logits outlive its
iteration and backward is a scalar multiply. This costs the same three matmuls as the plain
head, unlike recomputation by checkpointing.

Memory beyond the inputs: one chunk's logits and its float32 softmax (which becomes the
gradient, in the logits' buffer; both freed before the next chunk starts), the gradient of the
gathered hidden states and one float32 accumulator of the weight's gradient, which each chunk's
GEMM adds into in place (`add_weight_grad`) and backward scales in place; backward therefore
runs once per forward (a second backward through the same graph is refused by autograd's version
check). On a GPU the head is bound by memory traffic, not by its matmuls, so every pass over a
[C, V] tensor and over the [W, D] accumulator counts: fewer, larger chunks mean fewer.

The head is the custom op ``nedolm::fused_linear_cross_entropy``: torch.compile sees one opaque
call whose target count may be symbolic, so a compiled training forward has no graph break and
no recompile for a new target count. Rows whose target is ``IGNORE_INDEX`` add nothing, which
lets callers pad the target rows to a size of their choosing. Without gradients it can also
return each row's loss (``reduction="none"``), so an evaluation that splits the loss by row
(validation per source) still runs one forward per batch.
"""

# Shape legend: N target rows, D model dim, V logical vocab, W padded vocab, C chunk rows.
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch import Tensor

IGNORE_INDEX = -100
REDUCTIONS = ("sum", "mean", "none")
LOSS_CHUNK_ELEMENTS = 3 << 22  # logits elements per chunk: 48 MiB of float32 softmax
GRAD_WEIGHT_SLICE_ROWS = 8192  # vocabulary rows per product where no GEMM outputs float32


def fused_linear_cross_entropy(
    hidden_ND: Tensor,
    weight_WD: Tensor,
    targets_N: Tensor,
    *,
    vocab_size: int,
    reduction: str,
    fp32_logits: bool,
    chunk_elements: int = LOSS_CHUNK_ELEMENTS,
) -> Tensor:
    """Cross-entropy of `hidden @ weight[:vocab_size].T` against `targets`, never materialised.

    Args:
        hidden_ND: final hidden states of the rows to score.
        weight_WD: output embedding; rows past `vocab_size` are padding and never predicted.
        targets_N: target ids in [0, vocab_size), or IGNORE_INDEX for a row that adds nothing.
        vocab_size: logical vocabulary size.
        reduction: "sum" or "mean" over the rows whose target is not ignored, or "none": each
            row's loss, float32 [N], 0 where the target is ignored (no gradients: evaluation).
        fp32_logits: upcast each chunk's logits to float32 before the softmax.
        chunk_elements: logits elements computed at once (rows = chunk_elements // W).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {REDUCTIONS}, got {reduction!r}")
    device_type = hidden_ND.device.type
    compute_dtype = hidden_ND.dtype
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    with_grads = torch.is_grad_enabled() and (hidden_ND.requires_grad or weight_WD.requires_grad)
    if with_grads and reduction == "none":
        raise ValueError(
            "loss_reduction 'none' (a loss per row) has no gradient: evaluate under "
            "torch.no_grad(), train with 'sum' or 'mean'"
        )
    chunk_rows = max(1, chunk_elements // weight_WD.size(0))
    loss, _, _ = _fused_head(
        hidden_ND,
        weight_WD,
        targets_N,
        vocab_size,
        reduction,
        fp32_logits,
        compute_dtype,
        chunk_rows,
        with_grads,
    )
    return loss


@torch.library.custom_op("nedolm::fused_linear_cross_entropy", mutates_args=())
def _fused_head(
    hidden_ND: Tensor,
    weight_WD: Tensor,
    targets_N: Tensor,
    vocab_size: int,
    reduction: str,
    fp32_logits: bool,
    compute_dtype: torch.dtype,
    chunk_rows: int,
    with_grads: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, d loss / d hidden [N, D] in compute dtype, d loss / d weight [W, D] in fp32); the
    gradients are empty without ``with_grads``; the loss is [N] for ``reduction="none"``.

    Matmuls run over all W rows (an aligned width; an odd V like 32003 slows half-precision
    GEMMs), and the softmax reads only the first V columns: padding is never predicted.
    """
    with torch.autocast(hidden_ND.device.type, enabled=False):  # dtypes are chosen here
        return _chunked_loss(
            hidden_ND.to(compute_dtype),
            weight_WD.to(compute_dtype),
            targets_N,
            vocab_size,
            reduction,
            fp32_logits,
            chunk_rows,
            with_grads,
        )


def _chunked_loss(
    hidden: Tensor,
    weight: Tensor,
    targets_N: Tensor,
    vocab_size: int,
    reduction: str,
    fp32_logits: bool,
    chunk_rows: int,
    with_grads: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    n_rows = hidden.size(0)
    valid_N = targets_N != IGNORE_INDEX
    safe_targets_N = torch.where(valid_N, targets_N, 0)
    # A tensor, not a Python number: reading the count would stall on the device. No valid
    # target: the mean is 0/0 = nan, as F.cross_entropy's.
    scale = 1.0 / valid_N.sum().float() if reduction == "mean" else None
    per_row = reduction == "none"
    loss = torch.zeros(n_rows if per_row else (), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if with_grads else hidden.new_empty(0)
    grad_weight = (
        torch.zeros_like(weight, dtype=torch.float32) if with_grads else weight.new_empty(0)
    )
    head = _Head(weight, vocab_size, fp32_logits, scale)
    for start in range(0, n_rows, chunk_rows):
        rows = slice(start, start + chunk_rows)
        chunk = (hidden[rows], safe_targets_N[rows], valid_N[rows])
        if with_grads:
            loss_C = _add_chunk(head, *chunk, grad_hidden[rows], grad_weight)
        else:
            loss_C = _chunk_loss_and_logits_grad(head, *chunk, with_grads=False)[0]
        if per_row:
            loss[rows] = loss_C
        else:
            loss += loss_C.sum()
    if scale is not None:
        loss = loss * scale
    return loss, grad_hidden, grad_weight


class _Head(NamedTuple):
    """What every chunk of one head call shares."""

    weight: Tensor
    vocab_size: int
    fp32_logits: bool
    scale: Tensor | None  # 1 / the valid target count for a mean, else None


def _add_chunk(
    head: _Head,
    h_CD: Tensor,
    y_C: Tensor,
    valid_C: Tensor,
    grad_hidden_CD: Tensor,
    grad_weight: Tensor,
) -> Tensor:
    """One chunk's loss per row, its gradients added into the buffers given.

    A function of its own, as is `_chunk_loss_and_logits_grad`: a chunk's temporaries are freed
    when it returns, so none of them is alive while the next chunk allocates its logits.
    """
    loss_C, grad_CW = _chunk_loss_and_logits_grad(head, h_CD, y_C, valid_C, with_grads=True)
    assert grad_CW is not None
    torch.mm(grad_CW, head.weight, out=grad_hidden_CD)
    add_weight_grad(grad_weight, grad_CW, h_CD)
    return loss_C


def add_weight_grad(grad_weight_WD: Tensor, grad_CW: Tensor, h_CD: Tensor) -> None:
    """`grad_weight += grad.T @ h` into the float32 accumulator, as one GEMM where possible.

    The accumulator is read and written once per chunk either way; a separate half-precision
    product would add a [W, D] write and read (and its memory). Half-precision inputs need a
    GEMM with a float32 output (cuBLAS, torch >= 2.8); elsewhere the product is formed
    `GRAD_WEIGHT_SLICE_ROWS` vocabulary rows at a time, which bounds its memory.
    """
    if grad_CW.dtype == grad_weight_WD.dtype:
        grad_weight_WD.addmm_(grad_CW.T, h_CD)
    elif has_float32_output_gemm(grad_CW.device.type):
        torch.addmm(grad_weight_WD, grad_CW.T, h_CD, out_dtype=torch.float32, out=grad_weight_WD)
    else:
        for w in range(0, grad_weight_WD.size(0), GRAD_WEIGHT_SLICE_ROWS):
            vocab_rows = slice(w, w + GRAD_WEIGHT_SLICE_ROWS)
            grad_weight_WD[vocab_rows].add_(grad_CW[:, vocab_rows].T @ h_CD)  # no write-back


@functools.cache
def has_float32_output_gemm(device_type: str) -> bool:
    """Whether `torch.addmm(..., out_dtype=torch.float32)` takes bf16 inputs on this kind of
    device and adds them into a float32 tensor in place (CUDA since torch 2.8; not the CPU)."""
    ones = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
    accumulator = torch.ones(2, 2, dtype=torch.float32, device=device_type)
    try:
        torch.addmm(accumulator, ones, ones, out_dtype=torch.float32, out=accumulator)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bool((accumulator == 3.0).all())


def _chunk_loss_and_logits_grad(
    head: _Head, h_CD: Tensor, y_C: Tensor, valid_C: Tensor, *, with_grads: bool
) -> tuple[Tensor, Tensor | None]:
    """(loss of each row [C], 0 where ignored; d loss / d logits [C, W] in the weight's dtype or
    None); the float32 softmax dies with this call, before the gradient matmuls run.

    On a GPU one pass over the chunk's float32 [C, V] softmax takes about half as long as the
    chunk's matmul, so there are few: the maximum and the target logit are read from the
    half-precision logits, the softmax is formed by one subtraction into a new buffer and
    exponentiated in place, and the gradient is divided straight into the logits' buffer, with
    the ignored rows, the one-hot target and a mean's scale folded into each row's
    (subtrahend, divisor) pair.
    """
    weight, vocab_size, scale = head.weight, head.vocab_size, head.scale
    logits_CW = h_CD @ weight.T
    logits_CV = logits_CW[:, :vocab_size]
    target_logit_C = logits_CV.gather(1, y_C[:, None]).float()
    max_C = logits_CV.amax(dim=-1, keepdim=True).float()
    if head.fp32_logits and logits_CV.dtype != torch.float32:
        exp_CV = torch.sub(
            logits_CV, max_C, out=logits_CV.new_empty(logits_CV.shape, dtype=torch.float32)
        )
    else:  # the softmax in the logits' own dtype and buffer
        exp_CV = logits_CV.sub_(max_C)
    exp_CV.exp_()
    sum_C = exp_CV.sum(dim=-1, keepdim=True, dtype=torch.float32)
    lse_C = max_C + sum_C.log()
    loss_C = torch.where(valid_C, (lse_C - target_logit_C).squeeze(1), 0.0)
    if not with_grads:
        return loss_C, None
    # d(lse - logit_y) / d logits = (exp - sum * onehot(y)) / sum on valid rows, 0 elsewhere.
    exp_CV.scatter_add_(1, y_C[:, None], torch.where(valid_C[:, None], -sum_C, 0.0).to(exp_CV))
    divisor_C = torch.where(valid_C[:, None], sum_C, torch.inf)
    if scale is not None:  # mean: scale before rounding to compute dtype, as autograd would
        divisor_C = divisor_C / scale
    torch.div(exp_CV, divisor_C, out=logits_CV)
    logits_CW[:, vocab_size:] = 0.0
    return loss_C, logits_CW


@_fused_head.register_fake
def _(
    hidden_ND: Tensor,
    weight_WD: Tensor,
    targets_N: Tensor,
    vocab_size: int,
    reduction: str,
    fp32_logits: bool,
    compute_dtype: torch.dtype,
    chunk_rows: int,
    with_grads: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    loss = hidden_ND.new_empty(
        hidden_ND.shape[:1] if reduction == "none" else (), dtype=torch.float32
    )
    if not with_grads:
        return loss, hidden_ND.new_empty(0, dtype=compute_dtype), weight_WD.new_empty(0)
    grad_hidden = hidden_ND.new_empty(hidden_ND.shape, dtype=compute_dtype)
    return loss, grad_hidden, weight_WD.new_empty(weight_WD.shape, dtype=torch.float32)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    _, grad_hidden, grad_weight = output
    ctx.save_for_backward(grad_hidden, grad_weight)
    # Backward uses only the loss's gradient: materialised zeros for the two gradient outputs
    # would cost another [W, D] float32 buffer, the head's peak.
    ctx.set_materialize_grads(False)
    ctx.hidden_dtype, ctx.weight_dtype = inputs[0].dtype, inputs[1].dtype


def _backward(ctx: Any, grad_loss: Tensor, *_unused: Tensor) -> tuple[Tensor | None, ...]:
    """The gradients were computed in forward (they need the same softmax): scale them, in
    place (a copy of the float32 weight gradient would be the head's largest buffer)."""
    grad_hidden, grad_weight = ctx.saved_tensors
    return (
        grad_hidden.mul_(grad_loss).to(ctx.hidden_dtype),
        grad_weight.mul_(grad_loss).to(ctx.weight_dtype),
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


_fused_head.register_autograd(_backward, setup_context=_setup_context)
