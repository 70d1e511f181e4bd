"""One job per run directory: an OS lock (``flock``) held by the writing rank for the job's life.

A resubmitted SLURM job that starts while the first still runs would otherwise train into the
same ``checkpoints/`` and delete the other job's temporary files as stale. The kernel releases a
``flock`` when its holder dies (``kill -9`` included), so a crashed job never leaves a stale
lock: the lock file stays, but only the lock on it counts. The holder writes its host and PID
into the file so that a refused job can name it. Rank 0, the only rank that writes the run
directory (``main_rank_call``), takes the lock; a refusal is raised on every rank.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from nedolm.dist import DistInfo, main_rank_call

LOCK_FILE = "run.lock"
_held: dict[Path, int] = {}  # resolved run_dir -> file descriptor holding the lock


class RunDirLocked(RuntimeError):
    """Another live job holds the run directory."""


def acquire_run_lock(run_dir: Path) -> None:
    """Take the run directory's lock for this process, creating the directory if needed.

    Raises:
        RunDirLocked: another process holds it; the message names its host and PID.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode("utf-8", errors="replace").strip()
        os.close(fd)
        raise RunDirLocked(
            f"run_dir {run_dir} is in use by another job ({holder or 'holder not written yet'}, "
            f"lock {path}); wait for it to end or use another run_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
    _held[run_dir.resolve()] = fd


def release_run_lock(run_dir: Path) -> None:
    """Drop this process's lock on ``run_dir`` (no-op when it holds none)."""
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)


def holds_run_lock(run_dir: Path) -> bool:
    """True when this process holds ``run_dir``'s lock (and so is its only writer)."""
    return Path(run_dir).resolve() in _held


@contextlib.contextmanager
def run_dir_lock(info: DistInfo, run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir``'s lock on rank 0 for the block; a refusal is raised on every rank."""
    main_rank_call(info, "lock run directory", lambda: acquire_run_lock(run_dir))
    try:
        yield
    finally:
        if info.is_main:
            release_run_lock(run_dir)
