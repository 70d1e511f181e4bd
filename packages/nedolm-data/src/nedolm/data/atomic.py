"""Atomic file and directory installs: a reader sees the old content or the new, never a part.

The one owner of temp + fsync + rename for ``nedolm.data`` and the packages built on it
(``nedolm.train`` and the app). Temporary names are hidden (``.NAME.tmp-PID``) so that globs for
finished files never match them, and :func:`is_temporary` lets a cleaner recognise them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

TMP_MARK = ".tmp-"


def temporary_name(path: Path) -> Path:
    """The hidden, per-process sibling that ``path`` is written to before the rename."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def is_temporary(path: Path) -> bool:
    """True for a name :func:`temporary_name` produces (in any process)."""
    return path.name.startswith(".") and TMP_MARK in path.name


def process_alive(pid: int) -> bool:
    """Whether ``pid`` still runs (one of another user's counts): a leftover that a name ties to
    a process (``temporary_name``'s) is abandoned only once that process is gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_dir(directory: Path) -> None:
    """Make a rename inside ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> Path:
    """Write ``path`` through ``write(file)`` so that it appears complete or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    try:
        with tmp.open("wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """:func:`atomic_write` for content already in memory."""
    return atomic_write(path, lambda handle: handle.write(data))
