"""Process-group setup and teardown, and the rank queries that work without a group.

Every query degrades to the single-process answer (rank 0 of 1) when no group is
initialised, so library code never branches on "am I distributed?".
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nedolm.dist.env import DistEnvError, read_launch_env, resolve_timeout

_BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True, slots=True)
class DistInfo:
    """Where this process sits in the job; passed to the rank-safe helpers."""

    rank: int  # global rank, 0 for a single process
    world_size: int  # number of processes, 1 for a single process
    local_rank: int  # index on this node; the CUDA device under NCCL
    device: torch.device  # where this rank keeps its model and collective tensors

    @property
    def is_main(self) -> bool:
        """Rank 0 owns the side effects: file writes, INFO logs, metadata."""
        return self.rank == 0


def is_distributed() -> bool:
    """True once a process group is initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Global rank, 0 when not distributed."""
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """Number of ranks, 1 when not distributed."""
    return dist.get_world_size() if is_distributed() else 1


def is_main_rank() -> bool:
    """True on rank 0, and in a single process."""
    return get_rank() == 0


def collective_device() -> torch.device:
    """Device that tensors handed to this group's collectives must live on (NCCL: the GPU)."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_info() -> DistInfo:
    """This process's DistInfo, derived from the live group (rank 0 of 1 without one)."""
    if not is_distributed():
        return DistInfo(0, 1, 0, _single_process_device())
    launch = read_launch_env(os.environ)
    local_rank = launch.local_rank if launch is not None else 0
    return DistInfo(get_rank(), get_world_size(), local_rank, collective_device())


def setup_distributed(
    *,
    backend: str | None = None,
    timeout: datetime.timedelta | float | None = None,
) -> DistInfo:
    """Join the process group the launcher (torchrun or SLURM) describes, or run alone.

    NCCL is the default when CUDA is available (and binds this rank to GPU ``local_rank``);
    gloo otherwise. The timeout bounds every collective, so a peer that died or hangs turns
    into an error on the survivors instead of an infinite wait. It must exceed the longest
    rank-0 action the others wait on (see ``main_rank_call``).

    Args:
        backend: "nccl" or "gloo"; None picks NCCL with CUDA, gloo without.
        timeout: seconds or a timedelta; None reads ``NEDOLM_DIST_TIMEOUT_S``, else 30 min.

    Raises:
        DistEnvError: the launcher environment is incomplete, or NCCL is asked for without
            a usable GPU for this rank.
        ValueError: unknown backend or non-positive timeout.
    """
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS} or None, got {backend!r}")
    resolved_timeout = resolve_timeout(timeout, os.environ)
    launch = read_launch_env(os.environ)
    if launch is None:
        return DistInfo(0, 1, 0, _single_process_device())
    if is_distributed():
        raise RuntimeError("setup_distributed: a process group is already initialised")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        if launch.local_rank >= torch.cuda.device_count():
            raise DistEnvError(
                f"{launch.launcher} launch: local rank {launch.local_rank} has no GPU "
                f"({torch.cuda.device_count()} visible)"
            )
        device = torch.device("cuda", launch.local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend,
        init_method="env://",  # MASTER_ADDR/MASTER_PORT, checked by read_launch_env
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=resolved_timeout,
        # Binding the device makes NCCL connect eagerly, so a bad GPU fails here, not later.
        device_id=device if backend == "nccl" else None,
    )
    return DistInfo(launch.rank, launch.world_size, launch.local_rank, device)


def cleanup() -> None:
    """Destroy the process group if there is one; safe to call twice and without a group.

    Garbage is collected first: a DDP reducer or FSDP module freed after its gloo group can
    hang the exit or abort it ("terminate called without an active exception"), so callers
    drop their references to wrapped models before calling this.
    """
    if is_distributed():
        gc.collect()
        dist.destroy_process_group()


def _single_process_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
