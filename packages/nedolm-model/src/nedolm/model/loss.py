"""Assistant-only loss head: vocabulary projection and cross-entropy, chunked, targets only.

SFT trains a minority of positions, and at vocab 32k the [tokens, vocab] logits (plus their
gradient) dwarf everything else in a small model. The head therefore gathers the hidden states
of target positions only and walks them in chunks, computing each chunk's loss *and* its
gradients in the forward pass (the softmax is needed for both): no chunk's logits outlive its
iteration and backward is a scalar multiply. This costs the same three matmuls as the plain
head, unlike recomputation by checkpointing.
"""

# Shape legend: N target tokens, D model dim, V logical vocab, W padded vocab, C chunk rows.
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100
LOSS_CHUNK_ELEMENTS = 1 << 25  # logits elements per chunk: 128 MiB in fp32


# Eager under torch.compile: the chunk loop's trip count depends on the number of targets, so a
# compiled head would be specialised (recompiled) for every new count. Its work is a few large
# matmuls per chunk, which eager mode runs at full speed anyway.
@torch.compiler.disable
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
        hidden_ND: final hidden states at target positions.
        weight_WD: output embedding; rows past `vocab_size` are padding and never predicted.
        targets_N: target ids in [0, vocab_size).
        vocab_size: logical vocabulary size.
        reduction: "sum" or "mean" over the N targets.
        fp32_logits: upcast each chunk's logits to float32 before the softmax.
        chunk_elements: logits elements computed at once (rows = chunk_elements // W).
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"loss_reduction must be 'sum' or 'mean', got {reduction!r}")
    compute_dtype = hidden_ND.dtype
    if torch.is_autocast_enabled(hidden_ND.device.type):
        compute_dtype = torch.get_autocast_dtype(hidden_ND.device.type)
    args = (vocab_size, reduction == "mean", fp32_logits, compute_dtype, chunk_elements)
    if torch.is_grad_enabled() and (hidden_ND.requires_grad or weight_WD.requires_grad):
        return _FusedLinearCrossEntropy.apply(hidden_ND, weight_WD, targets_N, *args)
    return _chunked_loss(hidden_ND, weight_WD, targets_N, *args, with_grads=False)[0]


def _chunked_loss(
    hidden_ND: Tensor,
    weight_WD: Tensor,
    targets_N: Tensor,
    vocab_size: int,
    mean: bool,
    fp32_logits: bool,
    compute_dtype: torch.dtype,
    chunk_elements: int,
    *,
    with_grads: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Loss and, if asked, d loss / d hidden [N, D] and d loss / d weight [W, D] (fp32).

    Matmuls run over all W rows (an aligned width; an odd V like 32003 slows half-precision
    GEMMs), and the softmax reads only the first V columns: padding is never predicted.
    """
    weight = weight_WD.to(compute_dtype)
    hidden = hidden_ND.to(compute_dtype)
    n_targets = hidden.size(0)
    scale = 1.0 / n_targets if mean and n_targets else 1.0
    chunk_rows = max(1, chunk_elements // weight.size(0))
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden_ND = torch.empty_like(hidden) if with_grads else None
    grad_weight_WD = torch.zeros_like(weight, dtype=torch.float32) if with_grads else None
    for start in range(0, n_targets, chunk_rows):
        h_CD = hidden[start : start + chunk_rows]
        y_C = targets_N[start : start + chunk_rows]
        logits_CW = h_CD @ weight.T
        if fp32_logits:
            logits_CW = logits_CW.float()
        logits_CV = logits_CW[:, :vocab_size]
        lse_C = torch.logsumexp(logits_CV, dim=-1)
        target_logit_C = logits_CV.gather(1, y_C[:, None]).squeeze(1)
        loss += (lse_C - target_logit_C).float().sum()
        if grad_hidden_ND is None or grad_weight_WD is None:
            continue
        # d(lse - logit_y) / d logits = softmax - onehot(y), built in place over the logits.
        grad_CW = logits_CW.sub_(lse_C[:, None]).exp_()
        grad_CW[:, vocab_size:] = 0.0
        grad_CW[torch.arange(len(y_C), device=y_C.device), y_C] -= 1.0
        if scale != 1.0:  # mean: scale before rounding to compute_dtype, as autograd would
            grad_CW.mul_(scale)
        grad_CW = grad_CW.to(compute_dtype)
        grad_hidden_ND[start : start + chunk_rows] = grad_CW @ weight
        grad_weight_WD += (grad_CW.T @ h_CD).float()
    if mean:
        loss = loss / n_targets  # 0/0 = nan with no targets, as F.cross_entropy(mean)
    return loss, grad_hidden_ND, grad_weight_WD


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Gradients are computed in forward (they need the same softmax) and scaled in backward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden_ND: Tensor,
        weight_WD: Tensor,
        targets_N: Tensor,
        vocab_size: int,
        mean: bool,
        fp32_logits: bool,
        compute_dtype: torch.dtype,
        chunk_elements: int,
    ) -> Tensor:
        loss, grad_hidden_ND, grad_weight_WD = _chunked_loss(
            hidden_ND,
            weight_WD,
            targets_N,
            vocab_size,
            mean,
            fp32_logits,
            compute_dtype,
            chunk_elements,
            with_grads=True,
        )
        ctx.save_for_backward(grad_hidden_ND, grad_weight_WD)
        ctx.hidden_dtype, ctx.weight_dtype = hidden_ND.dtype, weight_WD.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden_ND, grad_weight_WD = ctx.saved_tensors
        grad_hidden = (grad_hidden_ND * grad_loss).to(ctx.hidden_dtype)
        grad_weight = (grad_weight_WD * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None
