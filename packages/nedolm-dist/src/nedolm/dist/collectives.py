"""Rank-safe collectives: no rank ever waits in a collective that a failed peer never enters.

Two mechanisms, one per kind of failure:

* Work that can fail (a rank-0 file write, local setup on each rank, pickling an object, a
  module that does not match its peers) runs *before* the collective inside try/except; the
  collective then carries the error text alongside the result, so every rank learns of every
  failure in the same call and raises the same ``RankError``.
* A peer that dies or hangs outside these helpers never arrives; the process group's timeout
  (``setup_distributed``) turns the wait into a ``CollectiveError`` naming the collective.

Every helper returns the single-process answer when no group is initialised.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
from collections.abc import Callable, Iterator
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from nedolm.dist.group import DistInfo, collective_device, get_rank, get_world_size, is_distributed

T = TypeVar("T")
Layout = list[tuple[str, tuple[int, ...], str, str]]  # (name, shape, dtype, device type)


class RankError(RuntimeError):
    """An action failed on some ranks; raised with the same message on every rank."""

    def __init__(self, action: str, failures: dict[int, str]) -> None:
        self.action = action
        self.failures = dict(sorted(failures.items()))  # rank -> "ExcType: message"
        super().__init__(f"{action} failed: " + " | ".join(_format_failures(self.failures)))


class CollectiveError(RuntimeError):
    """A collective itself failed: a peer died, or did not arrive within the group timeout."""


def gather_object(obj: object) -> list[object]:
    """Every rank's ``obj``, indexed by rank, on every rank.

    Each rank pickles its object before the exchange, so an unpicklable object on one rank
    becomes a ``RankError`` on all ranks instead of stranding its peers.
    """
    if not is_distributed():
        return [obj]
    payload, error = _pickle(obj)
    gathered = _all_gather("gather_object", (payload, error))
    failures = {rank: err for rank, (_, err) in enumerate(gathered) if err}
    if failures:
        raise RankError("gather_object", failures)
    return [pickle.loads(data) for data, _ in gathered]


def sum_all(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place and return it (unchanged in a single process).

    The tensor must live on ``collective_device()`` and have the same shape on every rank.
    """
    if is_distributed():
        with _collective("sum_all"):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def main_rank_call(info: DistInfo, action: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only; its return value or its error reaches every rank.

    Replaces ``if rank == 0: fn(); barrier()``, where an exception on rank 0 leaves the
    others in the barrier until the timeout. The other ranks wait in a broadcast while rank
    0 works, so the group timeout must exceed the slowest such action.

    Raises:
        RankError: on every rank, naming rank 0, ``action`` and the exception (or the reason
            the result could not be sent).
    """
    result: T | None = None
    payload, error, cause = b"", "", None
    if info.is_main:
        try:
            result = fn()
        except Exception as exc:
            error, cause = _describe(exc), exc
        else:
            if is_distributed():
                payload, error = _pickle(result)
    if is_distributed():
        box = [payload, error]
        with _collective(action):
            dist.broadcast_object_list(box, src=0)
        payload, error = box
        if not info.is_main and not error:
            result = pickle.loads(payload)
    if error:
        raise RankError(action, {0: error}) from cause
    return cast(T, result)  # fn's value (or rank 0's, unpickled) on every path that gets here


def collect_rank_errors(info: DistInfo, local_error: str) -> list[str]:
    """All ranks' non-empty errors as ``"rank N: message"``, the same list on every rank.

    Every rank must call this, with ``""`` when it has nothing to report.
    """
    return _format_failures(_gather_failures("collect_rank_errors", info, local_error))


def all_rank_call(info: DistInfo, action: str, fn: Callable[[], T]) -> T:
    """Run local, non-collective ``fn`` on every rank; a failure anywhere is raised everywhere.

    ``fn`` must not itself enter a collective: a rank that fails before reaching it would
    leave the others waiting.

    Raises:
        RankError: on every rank when any rank failed, with each failing rank's message.
    """
    result: T | None = None
    local_error, cause = "", None
    try:
        result = fn()
    except Exception as exc:
        local_error, cause = _describe(exc), exc
    failures = _gather_failures(action, info, local_error)
    if failures:
        raise RankError(action, failures) from cause
    return cast(T, result)  # fn returned on this rank


def sync_control_flags(*, rank0_archive_due: bool, local_stop: bool) -> tuple[bool, bool]:
    """Agree on ``(archive_due, stop)`` so every rank takes the same branch.

    Archiving is rank 0's decision (it owns the wall clock that schedules archives): other
    ranks' ``rank0_archive_due`` is ignored, not trusted to be False. Stopping is the OR of
    every rank's request (a SIGTERM may reach one rank only). One MAX all-reduce does both.
    """
    archive = bool(rank0_archive_due) and get_rank() == 0
    if not is_distributed():
        return archive, bool(local_stop)
    # int32, not bool: NCCL has no bool reduction.
    flags = torch.tensor([archive, local_stop], dtype=torch.int32, device=collective_device())
    with _collective("sync_control_flags"):
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    archive_due, stop = flags.tolist()
    return bool(archive_due), bool(stop)


def broadcast_module_state(module: torch.nn.Module, src: int = 0) -> None:
    """Copy ``src``'s parameters and buffers into every rank's module, bitwise.

    Lets rank 0 alone read a large checkpoint. The ranks first compare tensor names, shapes,
    dtypes and devices, so a mismatched module is a ``RankError`` on all ranks rather than a
    broadcast that fails on one rank while the others wait.
    """
    if not is_distributed():
        return
    if not 0 <= src < get_world_size():  # same answer on every rank, so raising here is safe
        raise ValueError(f"broadcast_module_state: src={src} outside [0, {get_world_size()})")
    layouts = _all_gather("broadcast_module_state", _layout(module))
    failures = {
        rank: f"module differs: {_first_difference(layouts[src], layout, src)}"
        for rank, layout in enumerate(layouts)
        if layout != layouts[src]
    }
    if failures:
        raise RankError("broadcast_module_state", failures)
    with torch.no_grad(), _collective("broadcast_module_state"):
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            dist.broadcast(tensor.data, src=src)


def barrier() -> None:
    """Wait for every rank (no-op in a single process); bounded by the group timeout."""
    if not is_distributed():
        return
    with _collective("barrier"):
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


@contextlib.contextmanager
def _collective(name: str) -> Iterator[None]:
    try:
        yield
    except RuntimeError as exc:  # torch reports dead or late peers as RuntimeError subclasses
        raise CollectiveError(
            f"{name}: collective failed on rank {get_rank()} (a peer may have died or missed "
            f"the process-group timeout): {exc}"
        ) from exc


def _all_gather(name: str, obj: object) -> list:
    gathered: list = [None] * get_world_size()
    with _collective(name):
        dist.all_gather_object(gathered, obj)
    return gathered


def _gather_failures(action: str, info: DistInfo, local_error: str) -> dict[int, str]:
    if not is_distributed():
        return {info.rank: local_error} if local_error else {}
    errors = _all_gather(action, local_error)
    return {rank: err for rank, err in enumerate(errors) if err}


def _format_failures(failures: dict[int, str]) -> list[str]:
    return [f"rank {rank}: {message}" for rank, message in sorted(failures.items())]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _pickle(obj: object) -> tuple[bytes, str]:
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), ""
    except Exception as exc:
        return b"", f"not picklable: {_describe(exc)}"


def _layout(module: torch.nn.Module) -> Layout:
    named = itertools.chain(module.named_parameters(), module.named_buffers())
    return [(name, tuple(t.shape), str(t.dtype), t.device.type) for name, t in named]


def _first_difference(reference: Layout, layout: Layout, src: int) -> str:
    for ours, theirs in zip(layout, reference):
        if ours != theirs:
            return f"{_describe_entry(ours)} here, {_describe_entry(theirs)} on rank {src}"
    return f"{len(layout)} tensors here, {len(reference)} on rank {src}"


def _describe_entry(entry: tuple[str, tuple[int, ...], str, str]) -> str:
    name, shape, dtype, device = entry
    return f"{name} {list(shape)} {dtype.removeprefix('torch.')} on {device}"
