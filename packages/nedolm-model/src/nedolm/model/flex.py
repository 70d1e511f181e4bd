"""FlexAttention over packed segments: one block-sparse call per layer, one mask per forward.

The document mask (a query sees the earlier tokens of its own segment) is built once per
micro-batch from `cu_seqlens` and shared by every layer. It is computed directly at block
granularity, so no [T, T] mask is ever materialised: for T = 16,384 and 128-token blocks that
is a 128 x 128 table instead of 268M booleans.
"""

# Shape legend: T packed tokens, H query heads, G kv heads, K head dim, Q = T padded up to a
# whole number of sparse blocks, nb = Q / BLOCK blocks.
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

BLOCK = 128  # flex_attention's default sparse block size

_compiled_flex: Callable[..., Tensor] | None = None


def document_block_mask(cu_seqlens: Tensor, n_tokens: int) -> BlockMask:
    """Block-causal mask of the segments `cu_seqlens` splits [0, n_tokens) into."""
    device = cu_seqlens.device
    n_blocks = -(-n_tokens // BLOCK)
    positions_Q = torch.arange(n_blocks * BLOCK, device=device, dtype=cu_seqlens.dtype)
    # Segment id per position; the padding past n_tokens forms one more segment of its own.
    doc_Q = torch.searchsorted(cu_seqlens[1:].contiguous(), positions_Q, right=True)
    first_b, last_b = doc_Q.view(n_blocks, BLOCK)[:, 0], doc_Q.view(n_blocks, BLOCK)[:, -1]
    kv_b = torch.arange(n_blocks, device=device)
    q_b1 = kv_b[:, None]
    # Ids rise along the row, so block ranges overlap iff the kv block's last id reaches the
    # query block's first, and a pair is all one segment iff the kv block's first id is the
    # query block's last (then a kv block strictly earlier is visible in full).
    visible = (kv_b <= q_b1) & (last_b[None, :] >= first_b[:, None])
    full = (kv_b < q_b1) & (first_b[None, :] == last_b[:, None])

    def same_segment_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (doc_Q[q_idx] == doc_Q[kv_idx]) & (q_idx >= kv_idx)

    return BlockMask.from_kv_blocks(
        *_sparse_rows(visible & ~full),
        *_sparse_rows(full),
        BLOCK_SIZE=BLOCK,
        mask_mod=same_segment_causal,
        seq_lengths=(n_tokens, n_tokens),
    )


def _sparse_rows(mask_bb: Tensor) -> tuple[Tensor, Tensor]:
    """Per query block: how many kv blocks are set, and their indices first ([1, 1, ...])."""
    counts_b = mask_bb.sum(-1, dtype=torch.int32)
    order_bb = torch.argsort(mask_bb.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts_b[None, None], order_bb.to(torch.int32)[None, None]


def flex_varlen(q_THK: Tensor, k_TGK: Tensor, v_TGK: Tensor, block_mask: BlockMask) -> Tensor:
    """Attention of the whole micro-batch in one call; GQA by flex's own head grouping."""
    q, k, v = (t.transpose(0, 1)[None] for t in (q_THK, k_TGK, v_TGK))  # [1, heads, T, K]
    run = _flex(q_THK.device)
    return run(q, k, v, block_mask=block_mask, enable_gqa=True)[0].transpose(0, 1)


def _flex(device: torch.device) -> Callable[..., Tensor]:
    """flex_attention as it runs fast here: compiled on accelerators, eager on CPU.

    Eager flex is an unfused reference that materialises the scores: fine for the CPU (where
    flex only runs forward, for tests) and inside an outer torch.compile, which fuses it anyway.
    """
    global _compiled_flex
    if torch.compiler.is_compiling():
        return flex_attention
    if device.type == "cpu":
        return _eager_flex
    if _compiled_flex is None:
        # Static shapes: a micro-batch's token count is fixed, and automatic dynamic shapes
        # (after the probe's tiny call) would trade the real shape's kernel for a generic one.
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def _eager_flex(*args: object, **kwargs: object) -> Tensor:
    with warnings.catch_warnings():  # "called without torch.compile": intended on CPU
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)
