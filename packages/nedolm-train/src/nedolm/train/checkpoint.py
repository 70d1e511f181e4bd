"""Checkpoints, archives and run metadata on disk, written so that a kill at any instant is safe.

Layout of a run directory::

    checkpoints/step-00000100.pt    full training state (model, optimizer, data cursor, RNG, ...)
    checkpoints/step-00000100/      the same, sharded (FSDP; see nedolm.train.sharded)
    archives/model-00000100.pt      weights + metadata only, on a wall-clock cadence
    run_metadata.json               one entry per start of the job

Every file is written to a hidden temporary name in its final directory, fsynced, renamed over
its final name and the directory fsynced: a name matching ``step-*.pt`` is therefore always a
complete file, and a ``kill -9`` leaves at most a ``.tmp`` file that readers ignore and the next
save by the run directory's lock holder (``run_lock``) removes. Payloads hold only tensors and
plain Python values, so every load uses ``torch.load(weights_only=True)`` and a checkpoint can
never execute code.

Each checkpoint carries a SHA-256 sidecar (``checksum``), so storage corruption (a node that
died while the filesystem flushed, flipped bytes) is caught on read. On resume the newest
checkpoint that fails to read or validate is skipped with a warning naming it and why, and the
newest valid one is used; with none valid the run refuses, listing each file and its reason.
Rotation never deletes the newest valid checkpoint. A save that fails for lack of space (or an
I/O error) leaves the previous checkpoints as they were and says how much space it needed.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from nedolm.data.atomic import atomic_write, atomic_write_bytes, is_temporary
from nedolm.train.checksum import HashingWriter, checksum_mismatch, checksum_path
from nedolm.train.run_lock import holds_run_lock

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
ARCHIVE_DIR = "archives"
METADATA_FILE = "run_metadata.json"
_CHECKPOINT_NAME = re.compile(r"^step-(\d{8})(\.pt)?$")  # a file, or a sharded directory
_SPACE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read, or its content is not a training checkpoint."""


def checkpoint_path(run_dir: Path, step: int) -> Path:
    """Final path of the checkpoint of ``step``."""
    return Path(run_dir) / CHECKPOINT_DIR / f"step-{step:08d}.pt"


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint file or sharded directory, from its name."""
    match = _CHECKPOINT_NAME.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not named like a checkpoint (step-NNNNNNNN[.pt])")
    return int(match.group(1))


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (files and sharded directories) as (step, path), oldest first.

    Temporaries are hidden names (``.step-...``), which never match.
    """
    directory = Path(run_dir) / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _CHECKPOINT_NAME.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint under ``run_dir`` that reads and validates, or None if there is none.

    Newer files that fail (truncated, flipped bytes, not a checkpoint) are skipped with a
    warning naming each and why.

    Raises:
        CheckpointError: checkpoints exist but none is valid; the message lists every file
            and its reason.
    """
    rejected = []
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            _validate(path)
        except CheckpointError as exc:
            log.warning("skipping checkpoint: %s; trying the previous one", exc)
            rejected.append(str(exc))
            continue
        return path
    if rejected:
        raise CheckpointError(
            f"no valid checkpoint in {Path(run_dir) / CHECKPOINT_DIR}: " + " | ".join(rejected)
        )
    return None


def rotate_checkpoints(run_dir: Path, written_step: int, keep_last: int, keep_every: int) -> None:
    """Delete all but the newest ``keep_last``, multiples of ``keep_every`` and ``written_step``."""
    found = list_checkpoints(run_dir)
    keep = {step for step, _ in found[-keep_last:]} | {written_step}
    if keep_every > 0:
        keep |= {step for step, _ in found if step % keep_every == 0}
    # A reused run directory may hold higher, corrupt steps: keep the newest one that loads.
    newest_valid = next(
        (step for step, path in reversed(found) if step == written_step or _loads(path)), None
    )
    keep.add(newest_valid)
    for step, path in found:
        if step in keep:
            continue
        if path.is_dir():  # a sharded checkpoint
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
            checksum_path(path).unlink(missing_ok=True)


def _loads(path: Path) -> bool:
    try:
        _validate(path)
    except CheckpointError:
        return False
    return True


def _validate(path: Path) -> None:
    """Read a checkpoint of either layout, raising CheckpointError if it is not usable."""
    if not path.is_dir():
        load_checkpoint(path)
        return
    from nedolm.train.sharded import (  # torch.distributed.checkpoint: only if used
        ShardedCheckpointError,
        read_payload,
        verify_sharded,
    )

    try:
        verify_sharded(path)
    except ShardedCheckpointError as exc:
        raise CheckpointError(str(exc)) from exc
    try:
        read_payload(path)
    except Exception as exc:
        raise CheckpointError(f"cannot read sharded checkpoint {path}: {exc}") from exc


def _remove_stale_tmp(run_dir: Path, directory: Path) -> None:
    # Only the lock holder writes here, one file at a time: any temp file (or checksum without
    # its checkpoint) is a leftover of a killed job. Without the lock it may be another job's.
    if directory.is_dir() and holds_run_lock(run_dir):
        for path in directory.iterdir():
            orphan = path.name.endswith(".pt.sha256") and not path.with_suffix("").exists()
            if is_temporary(path) or orphan:
                path.unlink(missing_ok=True)


def _payload_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_payload_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_payload_bytes(v) for v in value)
    return 0


def save_checkpoint(
    run_dir: Path, step: int, payload: dict[str, Any], *, keep_last: int, keep_every: int
) -> Path:
    """Atomically write the checkpoint of ``step``, then rotate older ones.

    Rotation keeps the ``keep_last`` highest steps, every multiple of ``keep_every`` (if > 0),
    always the file just written (so a reused run directory holding higher-numbered checkpoints
    can never make a save delete its own result) and the newest valid checkpoint.

    Raises:
        CheckpointError: out of space or an I/O error (ENOSPC, EDQUOT, EFBIG, EIO); the message
            names the file and the space needed; earlier checkpoints are untouched.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    path = checkpoint_path(run_dir, step)
    _remove_stale_tmp(Path(run_dir), path.parent)

    def write(handle: Any) -> None:
        hashing = HashingWriter(handle)
        try:
            torch.save(payload, hashing)
        except RuntimeError as exc:
            if hashing.error is None:
                raise
            raise hashing.error from exc
        atomic_write_bytes(checksum_path(path), f"{hashing.digest.hexdigest()}\n".encode())

    try:
        atomic_write(path, write)
    except OSError as exc:
        if exc.errno not in _SPACE_ERRORS:
            raise
        free = shutil.disk_usage(path.parent).free
        raise CheckpointError(
            f"cannot write checkpoint {path}: {os.strerror(exc.errno)}: it needs about "
            f"{_payload_bytes(payload) / 2**20:.1f} MiB, {free / 2**20:.1f} MiB free there; "
            "the previous checkpoints are intact: free space and restart to resume"
        ) from exc
    rotate_checkpoints(Path(run_dir), step, keep_last, keep_every)
    return path


def load_checkpoint(path: Path, *, verify: bool = True) -> dict[str, Any]:
    """Read a checkpoint or archive on CPU (memory-mapped), refusing corrupt or unreadable files.

    ``verify=False`` skips the checksum, a full read of the file: only for a file that
    ``latest_checkpoint`` has just verified.
    """
    mismatch = checksum_mismatch(path) if verify else None
    if mismatch is not None:
        raise CheckpointError(f"{path} is corrupt: {mismatch}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointError(
            f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not a NedoLM checkpoint (no 'model' entry)")
    return state


def save_model_archive(run_dir: Path, step: int, payload: dict[str, Any]) -> Path:
    """Atomically write a weights-only archive (``payload`` = model state + metadata)."""
    path = Path(run_dir) / ARCHIVE_DIR / f"model-{step:08d}.pt"
    return atomic_write(path, lambda handle: torch.save(payload, handle))


def write_run_metadata(run_dir: Path, entry: dict[str, Any]) -> Path:
    """Append ``entry`` to the run's metadata history (one entry per job start)."""
    path = Path(run_dir) / METADATA_FILE
    history = json.loads(path.read_text(encoding="utf-8"))["starts"] if path.exists() else []
    text = json.dumps({"starts": [*history, entry]}, indent=2, ensure_ascii=False) + "\n"
    return atomic_write_bytes(path, text.encode("utf-8"))
