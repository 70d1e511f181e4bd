"""Stop signals turn into a stop request that the loop honours at its next control point.

SIGTERM, SIGUSR1 (SLURM's warning) and a first SIGINT (Ctrl-C) only set a flag: the loop
agrees on stopping with every rank (``sync_control_flags``), writes a checkpoint and exits 0.
A second SIGINT aborts at once (``KeyboardInterrupt``); the trainer then names the checkpoint
that is left. Each signal prints one line when it arrives. DataLoader workers ignore these
signals (the loader's worker_init_fn), so a signal sent to the whole process group cannot kill
a worker under the main process before it has saved.

This module imports nothing heavy: ``nedolm-sft run`` installs the handlers before it imports
torch (``install_early``), so a signal during those seconds is kept, not fatal, and the trainer
takes over that request (``claim``).
"""

from __future__ import annotations

import os
import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequest:
    """A flag raised by SIGTERM/SIGUSR1/SIGINT (or by code, e.g. the max_hours limit)."""

    def __init__(self) -> None:
        self.requested = False
        self.reason: str | None = None  # "SIGTERM", "SIGUSR1", "SIGINT" or "max_hours"
        self.interrupts = 0  # SIGINTs received: the second one aborts

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                _say("SIGINT again: aborting now, without a checkpoint")
                raise KeyboardInterrupt
        if self.requested:
            _say(f"{name} received: already stopping")
            return
        self.requested = True
        self.reason = self.reason or name
        again = " (Ctrl-C again aborts without it)" if signum == signal.SIGINT else ""
        _say(f"{name} received: stopping at the next control point; a checkpoint is coming{again}")

    def install(self) -> StopRequest:
        """Route the stop signals to this object; returns self."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)
        return self

    def request(self, reason: str) -> None:
        """Ask for a stop from code (e.g. the max_hours limit)."""
        self.requested = True
        self.reason = self.reason or reason

    def describe(self) -> str:
        """Why a stop was requested, for the log (a peer's request when not this rank's)."""
        return self.reason or "requested by another rank"


_early: StopRequest | None = None


def install_early() -> StopRequest:
    """Install a StopRequest now, before slow imports, for the trainer to ``claim``."""
    global _early
    _early = StopRequest().install()
    return _early


def claim() -> StopRequest:
    """The request ``install_early`` installed (handed out once), else one installed now."""
    global _early
    stop, _early = _early, None
    return stop or StopRequest().install()


def _say(message: str) -> None:
    # os.write, not print or logging: the handler may run inside a write to stderr, where a
    # buffered write would raise "reentrant call"; logging's lock may be held mid-record.
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None else ""
    os.write(2, f"{prefix}nedolm: {message}\n".encode())
