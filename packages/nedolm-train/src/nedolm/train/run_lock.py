"""One job per run directory: a POSIX record lock held by the writing rank for the job's life.

A resubmitted SLURM job that starts while the first still runs would otherwise train into the
same ``checkpoints/`` and delete the other job's temporary files as stale. The lock is a POSIX
record lock (``fcntl.lockf``), not a ``flock``: a record lock belongs to the process, so the
DataLoader workers that the trainer forks do not share it, and a trainer killed with ``kill -9``
frees the run directory the instant it dies, while its workers may still be winding down (a
``flock`` belongs to the open file, which every forked worker shares, and refused a scheduler's
immediate requeue for seconds). The kernel releases the lock when its holder dies, so a crashed
job never leaves a stale lock: the lock file stays, but only the lock on it counts.

Record locks have one trap: closing *any* descriptor of the file in the holding process drops
the lock. So this module is the only code that opens the lock file, once per process and run
directory (a second acquire in the same process is refused), and reads it through the same
descriptor.

The file says who holds it, so that a refused job can name the holder: ``host H pid N`` while
held, ``released by host H pid N`` after a clean finish. A job that gets the lock while the file
still names a holder knows that holder ended without releasing (killed, node lost) and says so
in one log line. The holder is the run directory's only writer, so the hidden temporary files a
killed write left at its top (``nedolm.data.atomic``: the resolved config, the compile cache, the
stop record) are deleted when the lock is taken (``checkpoints/`` is cleaned between saves, by
``nedolm.train.checkpoint``). Rank 0, the only rank that writes the run directory
(``main_rank_call``), takes the lock; a refusal is raised on every rank.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from nedolm.data.atomic import is_temporary
from nedolm.dist import DistInfo, main_rank_call

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
RELEASED = "released by "
"""How the lock file of a cleanly finished job begins (then ``host H pid N``)."""
_held: dict[Path, tuple[int, int]] = {}  # resolved run_dir -> (descriptor, pid of the holder)


class RunDirLocked(RuntimeError):
    """Another live job holds the run directory."""


def acquire_run_lock(run_dir: Path) -> None:
    """Take the run directory's lock for this process, creating the directory if needed.

    Raises:
        RunDirLocked: another process holds it (the message names its host and PID), or this
            process holds it already.
    """
    run_dir = Path(run_dir)
    if holds_run_lock(run_dir):
        raise RunDirLocked(f"run_dir {run_dir} is already locked by this process ({_me()})")
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _read(fd)
        os.close(fd)
        if exc.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        raise RunDirLocked(
            f"run_dir {run_dir} is in use by another job ({holder or 'holder not written yet'}, "
            f"lock {path}); wait for it to end or use another run_dir"
        ) from None
    previous = _read(fd)
    if previous and not previous.startswith(RELEASED):
        log.warning(
            "run_dir %s: its lock names %s, which ended without releasing it (killed?); "
            "taking it over",
            run_dir,
            previous,
        )
    _write(fd, _me())
    _held[run_dir.resolve()] = (fd, os.getpid())
    _remove_temporaries(run_dir)


def release_run_lock(run_dir: Path) -> None:
    """Mark the lock file released, then drop this process's lock (no-op when it holds none)."""
    if not holds_run_lock(run_dir):
        return
    fd, _ = _held.pop(Path(run_dir).resolve())
    try:
        _write(fd, RELEASED + _me())
    finally:
        os.close(fd)  # drops the record lock


def holds_run_lock(run_dir: Path) -> bool:
    """True when this process holds ``run_dir``'s lock (and so is its only writer).

    False in a forked child of the holder (a DataLoader worker): it inherits the module's
    state, but not the lock.
    """
    entry = _held.get(Path(run_dir).resolve())
    return entry is not None and entry[1] == os.getpid()


@contextlib.contextmanager
def run_dir_lock(info: DistInfo, run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir``'s lock on rank 0 for the block; a refusal is raised on every rank."""
    main_rank_call(info, "lock run directory", lambda: acquire_run_lock(run_dir))
    try:
        yield
    finally:
        if info.is_main:
            release_run_lock(run_dir)


def _remove_temporaries(run_dir: Path) -> None:
    """Delete the temporary files at the top of ``run_dir``: with the lock taken, no live write
    owns them."""
    stale = sorted(p for p in run_dir.iterdir() if is_temporary(p) and p.is_file())
    for path in stale:
        path.unlink(missing_ok=True)
    if stale:
        log.info(
            "run_dir %s: removed %d temporary file(s) left by a killed write: %s",
            run_dir,
            len(stale),
            ", ".join(p.name for p in stale),
        )


def _me() -> str:
    return f"host {socket.gethostname()} pid {os.getpid()}"


def _read(fd: int) -> str:
    return os.pread(fd, 512, 0).decode("utf-8", errors="replace").strip()


def _write(fd: int, holder: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{holder}\n".encode(), 0)
