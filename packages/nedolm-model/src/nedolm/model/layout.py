"""Segment layout of packed rows: attention boundaries and restarting rotary positions.

Attention isolation alone is not enough for packed conversations: rotary positions must also
restart at zero after each boundary, otherwise a later conversation sees positions like 900
instead of 0 and behaves differently than when it runs alone.
"""

# Shape legend: B rows, S row length, N segments.
from __future__ import annotations

import torch
from torch import Tensor


def packed_layout(input_ids: Tensor, eos_id: int) -> tuple[Tensor, Tensor]:
    """Segment boundaries and per-segment positions of packed rows.

    Every EOS ends a segment and every row start begins one, so a segment never spans rows.

    Args:
        input_ids: [B, S] token ids.
        eos_id: id that closes a conversation.

    Returns:
        cu_seqlens: int32 [N + 1] offsets of segment starts in the flattened [B * S] tokens.
        position_ids: int64 [B, S], 0 at every segment start.

    Raises:
        ValueError: input_ids is not a non-empty 2-D tensor.
    """
    if input_ids.ndim != 2 or input_ids.numel() == 0:
        raise ValueError(
            f"packed_layout expects non-empty [B, S] input_ids, got {tuple(input_ids.shape)}"
        )
    starts_BS = torch.zeros_like(input_ids, dtype=torch.bool)
    starts_BS[:, 0] = True
    starts_BS[:, 1:] = input_ids[:, :-1] == eos_id
    offsets = starts_BS.reshape(-1).nonzero().flatten().to(torch.int32)
    end = torch.tensor([input_ids.numel()], dtype=torch.int32, device=input_ids.device)
    cu_seqlens = torch.cat((offsets, end))

    cols_BS = torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)
    last_start_BS = torch.where(starts_BS, cols_BS, 0).cummax(dim=1).values
    return cu_seqlens, cols_BS - last_start_BS


def positions_from_cu_seqlens(cu_seqlens: Tensor, total: int) -> Tensor:
    """Position of each of the `total` flattened tokens inside its segment."""
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    starts_T = torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts_T


def host_to_device(host: Tensor, device: torch.device) -> Tensor:
    """An asynchronous copy of layout built on the host: from pinned memory when the device is a
    GPU (a copy from pageable memory would wait for the device's queue to drain)."""
    if device.type == "cuda" and not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
