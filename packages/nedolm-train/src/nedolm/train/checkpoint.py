"""Checkpoints, archives and run metadata on disk, written so that a kill at any instant is safe.

Layout of a run directory::

    checkpoints/step-00000100.pt    full training state (model, optimizer, data cursor, RNG, ...)
    checkpoints/step-00000100/      the same, sharded (FSDP; see nedolm.train.sharded)
    archives/model-00000100.pt      weights + metadata only, on a wall-clock cadence
    run_metadata.json               one entry per start of the job

Every file is written to a hidden temporary name in its final directory, fsynced, renamed over
its final name and the directory fsynced: a name matching ``step-*.pt`` is therefore always a
complete file, and a ``kill -9`` leaves at most a ``.tmp`` file that readers ignore and the next
save removes. Payloads hold only tensors and plain Python values, so every load uses
``torch.load(weights_only=True)`` and a checkpoint can never execute code.

A checkpoint that exists under its final name but cannot be read (storage corruption, not an
interrupted write) is refused with an error naming it rather than silently skipped: falling back
would hide a storage fault and quietly lose steps. Delete the file to resume from the previous one.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from nedolm.data.atomic import atomic_write, atomic_write_bytes, is_temporary

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
ARCHIVE_DIR = "archives"
METADATA_FILE = "run_metadata.json"
_CHECKPOINT_NAME = re.compile(r"^step-(\d{8})(\.pt)?$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read, or its content is not a training checkpoint."""


def checkpoint_path(run_dir: Path, step: int) -> Path:
    """Final path of the checkpoint of ``step``."""
    return Path(run_dir) / CHECKPOINT_DIR / f"step-{step:08d}.pt"


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
    """The checkpoint with the highest step under ``run_dir``, or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def rotate_checkpoints(run_dir: Path, written_step: int, keep_last: int, keep_every: int) -> None:
    """Delete all but the newest ``keep_last``, multiples of ``keep_every`` and ``written_step``."""
    found = list_checkpoints(run_dir)
    keep = {step for step, _ in found[-keep_last:]} | {written_step}
    if keep_every > 0:
        keep |= {step for step, _ in found if step % keep_every == 0}
    for step, path in found:
        if step in keep:
            continue
        if path.is_dir():  # a sharded checkpoint
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _remove_stale_tmp(directory: Path) -> None:
    # Only rank 0 writes here, one file at a time: any temp file is a leftover of a killed job.
    if directory.is_dir():
        for path in directory.iterdir():
            if is_temporary(path):
                path.unlink(missing_ok=True)


def save_checkpoint(
    run_dir: Path, step: int, payload: dict[str, Any], *, keep_last: int, keep_every: int
) -> Path:
    """Atomically write the checkpoint of ``step``, then rotate older ones.

    Rotation keeps the ``keep_last`` highest steps, every multiple of ``keep_every`` (if > 0)
    and always the file just written, so a reused run directory holding higher-numbered
    checkpoints can never make a save delete its own result.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    path = checkpoint_path(run_dir, step)
    _remove_stale_tmp(path.parent)
    atomic_write(path, lambda handle: torch.save(payload, handle))
    rotate_checkpoints(Path(run_dir), step, keep_last, keep_every)
    return path


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint or archive on CPU (memory-mapped), refusing unreadable files."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointError(
            f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}. "
            "Delete it to resume from the previous checkpoint."
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
