"""After a collective failed: which peers are gone? A roll call through the rendezvous store.

A dead peer surfaces on the survivors as a transport error that names an address, not a rank
(gloo: ``Connection closed by peer [127.0.0.1]:49058``). Every survivor whose collective failed
writes its rank into the store (hosted by the torchrun agent, or by rank 0 under a plain
launch) and waits briefly for the others; the ranks that never answer are named as lost.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from nedolm.dist.collectives import CollectiveError
from nedolm.dist.group import get_rank, get_world_size, is_distributed

ROLL_CALL_S = 5.0
# How torch reports a peer that died mid-collective (the DDP reducer raises these unwrapped).
_TRANSPORT_MARKERS = ("Connection closed by peer", "Connection reset by peer", "NCCL", "gloo")


class PeerLostError(RuntimeError):
    """A collective failed because these ranks died (or stopped answering)."""


def lost_ranks(grace_s: float = ROLL_CALL_S) -> list[int]:
    """Ranks that did not answer a roll call within ``grace_s`` (every rank must be failing).

    Raises:
        RuntimeError: the store itself is unreachable (its host is gone).
    """
    store = dist.distributed_c10d._get_default_store()
    store.set(f"nedolm/roll_call/{get_rank()}", "here")
    deadline = time.monotonic() + grace_s
    while True:
        missing = [
            rank
            for rank in range(get_world_size())
            if not store.check([f"nedolm/roll_call/{rank}"])
        ]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.1)


def raise_if_peers_lost(exc: BaseException) -> None:
    """Re-raise a transport failure as ``PeerLostError`` naming the lost ranks, if any are lost.

    Only for errors that every live rank also sees (a failed collective): a rank-local error
    would leave the others inside a collective, unable to answer the roll call.
    """
    if not (is_distributed() and _is_transport_error(exc)):
        return
    first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    try:
        lost = lost_ranks()
    except RuntimeError as store_error:
        raise PeerLostError(
            f"rank {get_rank()}: lost contact with the job: the rendezvous store is unreachable "
            f"too ({store_error}); its host (rank 0 under a plain launch) is gone. Cause: "
            f"{first_line}"
        ) from exc
    if lost:
        names = ", ".join(str(rank) for rank in lost)
        raise PeerLostError(
            f"rank {get_rank()}: lost rank {names} (no answer within {ROLL_CALL_S:.0f} s: killed, "
            f"out of memory or node lost); resume from the last checkpoint. Cause: {first_line}"
        ) from exc


def _is_transport_error(exc: BaseException) -> bool:
    if isinstance(exc, (CollectiveError, dist.DistError)):
        return True
    return type(exc) is RuntimeError and any(m in str(exc) for m in _TRANSPORT_MARKERS)
