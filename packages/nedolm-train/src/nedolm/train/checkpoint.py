"""Checkpoints, archives and run metadata on disk, written so that a kill at any instant is safe.

Layout of a run directory::

    checkpoints/step-00000100.pt    full training state (model, optimizer, data cursor, RNG, ...)
    checkpoints/step-00000100/      the same, sharded (FSDP; see nedolm.train.sharded)
    archives/model-00000100.pt      weights + metadata only, on a wall-clock cadence
    run_metadata.json               one entry per start of the job
    compile_cache.bin               torch.compile's kernels, for a start elsewhere (compile_cache)

Every file is written to a hidden temporary name in its final directory, fsynced, renamed over
its final name and the directory fsynced: a name matching ``step-*.pt`` is therefore always a
complete file, and a ``kill -9`` leaves at most a ``.tmp`` file (or, mid sharded save, a
``.tmp-dcp`` directory) that readers ignore and the next save of either layout by the run
directory's lock holder (``run_lock``) removes. Payloads hold only tensors and
plain Python values, so every load uses ``torch.load(weights_only=True)`` and a checkpoint can
never execute code.

Each checkpoint carries its SHA-256 inside it and in a sidecar (``checksum``), so storage
corruption (a node that died while the filesystem flushed, flipped bytes) is caught on read,
also in a copy that lost its sidecar. On resume the newest checkpoint that fails to read or
validate is skipped with a warning naming it and why, and the newest valid one is used; with
none valid the run refuses, listing each file and its reason. A checkpoint that carries no
digest at all (no sidecar, none inside: written before digests existed) cannot be verified, and
counts as invalid for a resume unless the user trusts it (``--trust-unverified``).
Since ``MODEL_DIGEST`` exists a checkpoint also carries the digest of its model tensors alone,
so that a reader of the weights (``read_model_checkpoint``: generate, chat, export, a base for
SFT) maps the file and reads and hashes only the model, never the optimizer state; a file
without it (an earlier version's) is verified whole, as before.

A resume (``load_checkpoint(mmap=False)``) reads the file into memory it owns: nothing of a
loaded checkpoint stays mapped, so rotation deleting it frees its space at once.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from nedolm.data.atomic import atomic_write, atomic_write_bytes, is_temporary
from nedolm.dist import get_rank
from nedolm.train.checksum import (
    DigestWriter,
    checksum_mismatch,
    checksum_path,
    has_digest,
    tensors_sha256,
)
from nedolm.train.faults import maybe_inject
from nedolm.train.run_lock import holds_run_lock

log = logging.getLogger(__name__)
T = TypeVar("T")

CHECKPOINT_DIR = "checkpoints"
ARCHIVE_DIR = "archives"
METADATA_FILE = "run_metadata.json"
_CHECKPOINT_NAME = re.compile(r"^step-(\d{8})(\.pt)?$")  # a file, or a sharded directory
_SPACE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)
MODEL_DIGEST = "model_sha256"
"""Payload key of ``tensors_sha256(payload["model"])``, added by ``save_checkpoint``."""


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


def latest_checkpoint(run_dir: Path, *, require_digest: bool = False) -> Path | None:
    """The newest checkpoint under ``run_dir`` that reads and validates, or None if there is none.

    Newer files that fail (truncated, flipped bytes, not a checkpoint) are skipped with a
    warning naming each and why.

    Args:
        require_digest: also skip checkpoints that carry no digest (they cannot be verified).
            Off for a base run, whose checkpoints may come from another program.

    Raises:
        CheckpointError: checkpoints exist but none is valid; the message lists every file
            and its reason.
    """
    found = _newest_valid(run_dir, lambda path: _validate(path, require_digest=require_digest))
    return None if found is None else found[0]


def newest_model_checkpoint(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint whose model reads and verifies, and its ``read_model_checkpoint``
    content; None without checkpoints. Skips and raises like ``latest_checkpoint``, but reads
    only the model tensors of each file (a sharded directory is verified whole)."""
    return _newest_valid(run_dir, read_model_checkpoint)


def _newest_valid(run_dir: Path, read: Callable[[Path], T]) -> tuple[Path, T] | None:
    """The newest checkpoint that ``read`` accepts (raising CheckpointError otherwise), with what
    ``read`` returned; the ones skipped are logged, and listed when none is accepted."""
    rejected = []
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            content = read(path)
        except CheckpointError as exc:
            log.warning("skipping checkpoint: %s; trying the previous one", exc)
            rejected.append(str(exc))
            continue
        return path, content
    if rejected:
        raise CheckpointError(
            f"no valid checkpoint in {Path(run_dir) / CHECKPOINT_DIR}: " + " | ".join(rejected)
        )
    return None


def resume_checkpoint(run_dir: Path, *, trust_unverified: bool = False) -> Path | None:
    """The checkpoint an SFT run resumes from: the newest verified one (``latest_checkpoint``).

    A run directory's own checkpoints always carry a digest; one without (a copy that lost its
    sidecar, written by a version before the digests) is skipped, unless ``trust_unverified``
    (``--trust-unverified``) takes the newest readable one anyway, with a warning.
    """
    path = latest_checkpoint(run_dir, require_digest=not trust_unverified)
    if path is not None and trust_unverified and not _verifiable(path):
        log.warning("resuming from %s unverified: it carries no digest (--trust-unverified)", path)
    return path


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


def _unverifiable(path: Path) -> CheckpointError:
    if path.is_dir():
        what = "its manifest is format 1, written before the digests"
    else:
        what = f"no {checksum_path(path).name} beside it and none inside it"
    return CheckpointError(
        f"{path} carries no digest ({what}), so it cannot be verified; "
        "restart with --trust-unverified to resume from it anyway"
    )


def _verifiable(path: Path) -> bool:
    """Whether a checkpoint (one that ``_validate`` read) carries digests to check."""
    if not path.is_dir():
        return has_digest(path)
    from nedolm.train.sharded import has_digests

    return has_digests(path)


def _validate(path: Path, *, require_digest: bool = False) -> None:
    """Read a checkpoint of either layout, raising CheckpointError if it is not usable."""
    if not path.is_dir():
        if require_digest and not has_digest(path):
            raise _unverifiable(path)
        load_checkpoint(path)
        return
    from nedolm.train.sharded import (  # torch.distributed.checkpoint: only if used
        ShardedCheckpointError,
        has_digests,
        read_payload,
        verify_sharded,
    )

    try:
        verify_sharded(path)
    except ShardedCheckpointError as exc:
        raise CheckpointError(str(exc)) from exc
    if require_digest and not has_digests(path):
        raise _unverifiable(path)
    try:
        read_payload(path)
    except Exception as exc:
        raise CheckpointError(f"cannot read sharded checkpoint {path}: {exc}") from exc


def remove_stale_temporaries(run_dir: Path) -> None:
    """Delete what killed saves left in ``checkpoints/``: temporary files and sharded
    directories, and sidecars without their checkpoint; only by the run directory's lock
    holder, between saves (without the lock they may be another live job's)."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    if not (directory.is_dir() and holds_run_lock(run_dir)):
        return
    for path in directory.iterdir():
        orphan = path.name.endswith(".pt.sha256") and not path.with_suffix("").exists()
        if path.is_dir() and is_temporary(path):
            shutil.rmtree(path)
        elif is_temporary(path) or orphan:
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
    remove_stale_temporaries(run_dir)
    if isinstance(payload.get("model"), dict):
        payload = {**payload, MODEL_DIGEST: tensors_sha256(payload["model"])}

    def write(handle: Any) -> None:
        digest = _save_signed(payload, handle)
        maybe_inject("checkpoint_commit", get_rank())  # written, not yet durable nor renamed
        atomic_write_bytes(checksum_path(path), f"{digest}\n".encode())

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


def _save_signed(payload: dict[str, Any], handle: Any) -> str:
    """``torch.save`` with the digest inside the file; returns the whole file's hex digest."""
    signed = DigestWriter(handle)
    try:
        torch.save(payload, signed)
    except RuntimeError as exc:
        if signed.error is None:
            raise
        raise signed.error from exc
    return signed.finish()


def load_checkpoint(path: Path, *, verify: bool = True, mmap: bool = True) -> dict[str, Any]:
    """Read a checkpoint or archive on CPU, refusing corrupt or unreadable files.

    ``verify=False`` skips the checksum, a full read of the file: only for a file that
    ``latest_checkpoint`` has just verified. ``mmap=True`` maps the file: cheap for a look,
    but its tensors are views of the file for as long as any of them lives (the mapping keeps
    a rotated-away file's space); ``mmap=False`` reads it into owned memory, for state that
    lives on (a resume's optimizer state).
    """
    mismatch = checksum_mismatch(path) if verify else None
    if mismatch is not None:
        raise CheckpointError(f"{path} is corrupt: {mismatch}")
    return _torch_load(path, mmap=mmap)


def read_model_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint or archive, memory-mapped, with its model tensors verified: only their pages
    are read (the optimizer state stays unread on disk). A file without ``MODEL_DIGEST`` (an
    earlier version's) is verified whole. Copy the weights out (``load_state_dict``) and drop
    the dict: nothing stays mapped then.

    Raises:
        CheckpointError: unreadable, not a checkpoint, or the model (or file) digest differs.
    """
    if Path(path).is_dir():
        _validate(path)
        from nedolm.train.sharded import read_payload

        return read_payload(path)
    state = _torch_load(path, mmap=True)
    expected = state.get(MODEL_DIGEST)
    if expected is None:
        mismatch = checksum_mismatch(path)
    else:
        actual = tensors_sha256(state["model"])
        mismatch = (
            None
            if actual == expected
            else (
                f"model tensors sha256 {actual[:16]}... do not match the digest inside it "
                f"({str(expected)[:16]}...)"
            )
        )
    if mismatch is not None:
        del state  # the error's traceback must not keep the file mapped
        raise CheckpointError(f"{path} is corrupt: {mismatch}")
    return state


def _torch_load(path: Path, *, mmap: bool) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        raise CheckpointError(
            f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path} is not a NedoLM checkpoint (no 'model' entry)")
    return state


def save_model_archive(run_dir: Path, step: int, payload: dict[str, Any]) -> Path:
    """Atomically write a weights-only archive (``payload`` = model state + metadata), its
    digest inside it."""
    path = Path(run_dir) / ARCHIVE_DIR / f"model-{step:08d}.pt"
    return atomic_write(path, lambda handle: _save_signed(payload, handle))


def write_run_metadata(run_dir: Path, entry: dict[str, Any]) -> Path:
    """Append ``entry`` to the run's metadata history (one entry per job start)."""
    path = Path(run_dir) / METADATA_FILE
    history = json.loads(path.read_text(encoding="utf-8"))["starts"] if path.exists() else []
    text = json.dumps({"starts": [*history, entry]}, indent=2, ensure_ascii=False) + "\n"
    return atomic_write_bytes(path, text.encode("utf-8"))
