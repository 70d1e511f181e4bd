"""A rank whose launcher died stops as if the scheduler had sent SIGTERM.

torch's elastic agent (inside ``nedolm-sft launch``) starts every rank in a session of its own,
so a ``kill -9`` of the launcher, or of its process group, reaches no rank and sends no
parent-death signal: the ranks would train on as orphans, checkpointing and holding the run
dir's lock, and a scheduler's requeue of the job would be refused until they finished.

``launch`` puts its pid in ``NEDOLM_LAUNCHER_PID``; each rank watches that process through a
pidfd (readable once the process has exited, whoever its parent is, and immune to pid reuse
once opened) and then sends itself SIGTERM, so the rank takes the one stop path there is:
agree with the other ranks, write the checkpoint, release the lock, exit 0.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
from collections.abc import Mapping

LAUNCHER_PID_ENV = "NEDOLM_LAUNCHER_PID"


def watch_launcher(environ: Mapping[str, str] = os.environ) -> threading.Thread | None:
    """Start the watch when ``environ`` names a launcher; None when it does not.

    Call it after the stop-signal handlers are installed: a launcher that is already gone
    makes the SIGTERM come at once.

    Raises:
        ValueError: ``NEDOLM_LAUNCHER_PID`` is not a pid.
    """
    raw = environ.get(LAUNCHER_PID_ENV)
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{LAUNCHER_PID_ENV}={raw!r} is not a process id")
    launcher = int(raw)
    try:
        pidfd = os.pidfd_open(launcher)
    except ProcessLookupError:
        pidfd = None  # gone before this rank got here
    thread = threading.Thread(
        target=_stop_when_gone, args=(launcher, pidfd), name="launcher-watch", daemon=True
    )
    thread.start()
    return thread


def _stop_when_gone(launcher: int, pidfd: int | None) -> None:
    if pidfd is not None:
        select.select([pidfd], [], [])  # readable once the launcher has exited
        os.close(pidfd)
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None else ""
    message = f"{prefix}nedolm: the launcher (pid {launcher}) is gone: stopping as on SIGTERM\n"
    with contextlib.suppress(OSError):  # stderr may have died with the launcher's terminal
        os.write(2, message.encode())
    os.kill(os.getpid(), signal.SIGTERM)
