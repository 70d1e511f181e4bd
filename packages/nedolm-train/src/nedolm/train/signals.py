"""SIGTERM/SIGUSR1 turn into a stop request that the loop honours at its next control point.

The handler only sets a flag: the loop agrees on stopping with every rank
(``sync_control_flags``), writes a checkpoint and exits 0. DataLoader workers ignore these
signals (the loader's worker_init_fn), so a signal sent to the whole process group cannot kill a
worker under the main process before it has saved.
"""

from __future__ import annotations

import signal
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """A flag raised by SIGTERM/SIGUSR1 (or by code, e.g. the max_hours limit)."""

    def __init__(self) -> None:
        self.requested = False
        self.reason: str | None = None  # "SIGTERM", "SIGUSR1" or "max_hours"

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only set flags: the handler may run in the middle of any Python code (even a log
        # call), so the loop reports the signal when it acts on it.
        self.requested = True
        self.reason = signal.Signals(signum).name

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
