"""Asynchronous checkpoints (``train.async_checkpoint``): stage the state to CPU memory, train
on, write it on a background thread.

Writing a multi-GB checkpoint (serialise, hash, fsync) stalls training for as long as it takes;
copying the state to CPU memory takes a fraction of that (torchtitan's ``async_with_pinned_mem``,
Megatron's ``--async-save`` work the same way). ``StagedCopies`` makes the copy: every tensor
into a CPU buffer of its own storage (pinned when the source is on CUDA and the machine allows
it), kept and reused by the next checkpoint, so a save allocates nothing after the first. The
buffers are cut from a few large blocks (``carve``): torch's pinned allocator rounds every
allocation up to a power of two, which for one buffer per tensor (as torch's own
``distributed.checkpoint`` staging allocates) costs ~31% more host memory than the 8.7 GiB state
of ``nedolm-0.8b`` and its AdamW moments; the blocks are powers of two already, 1% over
(both counted from the buffer sizes, not measured on a GPU). The copy is a real one
on CPU too: the optimizer updates parameters in place while the write goes on. Fresh memory is
slow to get (page faults, zeroing: the first checkpoint of a 300M-parameter run paused 11 s on
CPU instead of 0.7 s), so ``reserve`` allocates and touches buffers of the sizes the state will
have on a thread of its own, ahead of the first checkpoint: the trainer starts it before the
compile warm-up, which hides it (pinning ~9 GiB for a 0.8B model and its AdamW moments slowed
an H200's first 15 steps 3x when it overlapped training instead).

``BackgroundWrite`` runs one write at a time on a daemon thread and keeps its failure for the
caller's next look (the loop turns it into an error on every rank at the next control point). A
process killed mid-write leaves what a killed synchronous save leaves: a temporary file and the
previous checkpoints intact (the write uses the same protocol, ``save_checkpoint``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nedolm.train.faults import maybe_inject

log = logging.getLogger(__name__)

_StorageKey = tuple[torch.device, int, int]
_SpareKey = tuple[bool, int]  # (pinned, nbytes)
BLOCK_BYTES = 1 << 28  # staging buffers are cut from blocks of 256 MiB (or the largest buffer's)
PAGE_BYTES = 4096


class StagedCopies:
    """CPU copies of a nested state (dicts, lists, tuples of tensors and plain values).

    Tensors sharing a storage (tied weights) share one copy, so the written file is the one a
    synchronous save writes. Buffers are reused by the next ``stage`` call: call it only when
    the previous staged state is no longer being written.
    """

    def __init__(self) -> None:
        self._buffers: dict[_StorageKey, torch.UntypedStorage] = {}
        self._spares: dict[_SpareKey, list[torch.UntypedStorage]] = {}
        self._reserving: threading.Thread | None = None
        self._pinning = True  # until the machine refuses to pin (then pageable, said once)

    def reserve(self, *states: Any) -> None:
        """Allocate and touch, in the background, one buffer per distinct storage of each of
        ``states``: tensors of those sizes (not necessarily those tensors: optimizer moments
        that do not exist yet can be reserved as their parameters) that ``stage`` will copy.
        ``stage`` waits for it, and so does the interpreter's exit (not a daemon thread: a
        process exiting mid-allocation aborts in C++ teardown, hiding its real exit code)."""
        self.wait_for_reserve()
        tensors = [t for state in states for t in _distinct_storages(state).values()]
        sizes = [_spare_key(t) for t in tensors]
        cuda = next((t.device for t in tensors if t.device.type == "cuda"), None)

        def allocate() -> None:
            maybe_inject("staging_reserve", 0)  # (tests: a slow reservation)
            if cuda is not None:  # pin through this rank's GPU, not a new context on GPU 0
                torch.cuda.set_device(cuda)
            try:
                for buffer in self._add_spares(sizes):
                    buffer.fill_(0)  # fault the pages in
            except (RuntimeError, MemoryError) as exc:  # e.g. a locked-memory limit
                log.warning(
                    "staging buffers for asynchronous checkpoints not reserved (%s): the first "
                    "checkpoint allocates them, and pauses longer",
                    exc,
                )

        self._reserving = threading.Thread(target=allocate, name="staging-buffers")
        self._reserving.start()

    def wait_for_reserve(self) -> None:
        """Until ``reserve``'s allocations are done (or failed)."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def stage(self, state: Any) -> Any:
        """A copy of ``state`` whose tensors live in CPU memory owned by this object."""
        self.wait_for_reserve()
        self._add_spares(self._unbuffered(state))
        used: dict[_StorageKey, torch.UntypedStorage] = {}
        staged = self._copy(state, used)
        if any(key[0].type == "cuda" for key in used):
            torch.cuda.synchronize()  # the copies into pinned memory were asynchronous
        self._buffers = used  # buffers of tensors gone since the last stage are freed
        self._spares.clear()  # and reserved ones that no tensor took
        return staged

    def _copy(self, value: Any, used: dict[_StorageKey, torch.UntypedStorage]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value, used)
        if isinstance(value, dict):
            return {key: self._copy(item, used) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(item, used) for item in value)
        return value  # str, int, float, bool, None: immutable

    def _copy_tensor(
        self, tensor: torch.Tensor, used: dict[_StorageKey, torch.UntypedStorage]
    ) -> torch.Tensor:
        key = _key(tensor)
        target = used.get(key)
        if target is None:
            target = self._buffers.get(key)
            if target is None:  # a spare of its size exists: stage() carved what was missing
                target = self._spares[_spare_key(tensor)].pop()
            target.copy_(tensor.untyped_storage(), non_blocking=tensor.device.type == "cuda")
            used[key] = target
        view = torch.empty(0, dtype=tensor.dtype)
        return view.set_(target, tensor.storage_offset(), tensor.size(), tensor.stride())

    def _unbuffered(self, state: Any) -> list[_SpareKey]:
        """The buffers ``state``'s storages need beyond the kept and the spare ones."""
        spare = Counter({key: len(buffers) for key, buffers in self._spares.items()})
        needed: list[_SpareKey] = []
        for key, tensor in _distinct_storages(state).items():
            if key not in self._buffers:
                size = _spare_key(tensor)
                if spare[size] > 0:
                    spare[size] -= 1
                else:
                    needed.append(size)
        return needed

    def _add_spares(self, sizes: list[_SpareKey]) -> list[torch.UntypedStorage]:
        """New spare buffers of these sizes, pinned and pageable ones carved apart."""
        added: list[torch.UntypedStorage] = []
        for pinned in (True, False):
            wanted = [nbytes for is_pinned, nbytes in sizes if is_pinned == pinned]
            if not wanted:
                continue
            buffers = carve(wanted, functools.partial(self._new_buffer, pinned))
            for nbytes, buffer in zip(wanted, buffers, strict=True):
                self._spares.setdefault((pinned, nbytes), []).append(buffer)
            added += buffers
        return added

    def _new_buffer(self, pinned: bool, nbytes: int) -> torch.UntypedStorage:
        """``nbytes`` of CPU memory, pinned when asked and the machine gives it. Pinned memory
        can be refused where pageable memory is not (a locked-memory limit): the copies into
        pageable memory are slower, not wrong (``stage`` synchronizes), and a run must not end
        at its first checkpoint for it."""
        if pinned and self._pinning:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
            except (RuntimeError, MemoryError) as exc:
                self._pinning = False
                log.warning(
                    "pinned memory refused (%s): asynchronous checkpoints stage into pageable "
                    "memory, and pause longer",
                    exc,
                )
        return torch.empty(nbytes, dtype=torch.uint8).untyped_storage()


def carve(
    sizes: list[int], allocate: Callable[[int], torch.UntypedStorage]
) -> list[torch.UntypedStorage]:
    """One buffer of each of ``sizes`` bytes, cut from the blocks ``plan_blocks`` lays out,
    each ``allocate``d. A buffer keeps its block alive and is a storage of its own, so
    ``torch.save`` writes only its bytes: the file is the one separate buffers give."""
    block_sizes, placements = plan_blocks(sizes)
    blocks = [allocate(nbytes) for nbytes in block_sizes]
    return [
        blocks[block][offset : offset + nbytes]
        for nbytes, (block, offset) in zip(sizes, placements, strict=True)
    ]


def plan_blocks(sizes: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """(block sizes, each size's (block, offset)) by first-fit decreasing.

    torch's pinned allocator rounds each allocation up to a power of two; a block holding many
    buffers wastes only its unused tail. Blocks are ``BLOCK_BYTES`` or the largest buffer's
    power of two, whichever is larger, each shrunk to the power of two it fills. Each buffer
    starts on a page of its block (aligned for any dtype).
    """
    block_bytes = max(BLOCK_BYTES, _power_of_two_ceil(max(sizes, default=0)))
    room: list[int] = []  # bytes still free in each block
    placements: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        span = -(-sizes[index] // PAGE_BYTES) * PAGE_BYTES
        block = next((b for b, free in enumerate(room) if free >= span), len(room))
        if block == len(room):
            room.append(block_bytes)
        placements[index] = block, block_bytes - room[block]
        room[block] -= span
    return [_power_of_two_ceil(block_bytes - free) for free in room], placements


def _power_of_two_ceil(nbytes: int) -> int:
    return 1 << max(nbytes - 1, 0).bit_length()


def _key(tensor: torch.Tensor) -> _StorageKey:
    """Identifies a tensor's storage (tied weights share one), stable across training steps."""
    storage = tensor.untyped_storage()
    return (tensor.device, storage.data_ptr(), storage.nbytes())


def _spare_key(tensor: torch.Tensor) -> _SpareKey:
    """A buffer for ``tensor``: its storage's size, pinned when the tensor is on CUDA."""
    return tensor.device.type == "cuda", tensor.untyped_storage().nbytes()


def _distinct_storages(state: Any) -> dict[_StorageKey, torch.Tensor]:
    """One tensor of each storage in ``state`` (tied weights are one)."""
    return {_key(tensor): tensor for tensor in _tensors(state)}


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


class BackgroundWrite:
    """At most one write in flight on a daemon thread; its failure waits for ``collect``.

    Daemon: a job that fails or aborts does not hang on a write it no longer waits for (that
    write is then lost like one cut by ``kill -9``: the previous checkpoint stays).
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._seconds = 0.0

    def submit(self, name: str, write: Callable[[], object]) -> None:
        """Start ``write()`` in the background.

        Raises:
            RuntimeError: a previous write has not been collected.
        """
        if self._thread is not None:
            raise RuntimeError("a background write is still in flight: collect it first")
        self._error = None

        def run() -> None:
            started = time.monotonic()
            try:
                write()
            except BaseException as exc:  # handed to the caller by collect()
                self._error = exc
            finally:
                self._seconds = time.monotonic() - started

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        """A write was submitted and not yet collected (it may have finished)."""
        return self._thread is not None

    def finished(self) -> bool:
        """No write, or the submitted one has returned or failed."""
        return self._thread is None or not self._thread.is_alive()

    def collect(self) -> float:
        """Wait for the write; returns its duration in seconds, or raises its error."""
        if self._thread is None:
            raise RuntimeError("no background write to collect")
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._seconds
