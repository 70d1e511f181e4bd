"""Stop signals turn into a stop request that the loop honours after the next optimizer step.

SIGTERM, SIGUSR1 (SLURM's warning) and a first SIGINT (Ctrl-C) only set a flag: the loop
agrees on stopping with every rank (in the step's all-reduce), writes a checkpoint and exits 0.
A second SIGINT aborts at once (``KeyboardInterrupt``); the trainer then names the checkpoint
that is left. Each signal prints one line when it arrives, and promises a checkpoint only once
training has begun (before step 1 the job stops with nothing new to save). That line survives a
closed stderr: under ``nedolm-sft run ... | tee log`` a Ctrl-C ends tee too, and a
``BrokenPipeError`` raised inside the handler would abort the step it interrupted.
DataLoader workers ignore these
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
        self.training = False
        """Set by the loop when it starts stepping: a stop then ends on a checkpoint."""

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
        if not self.training:
            _say(f"{name} received: stopping before training starts; nothing new to save")
            return
        again = " (Ctrl-C again aborts without it)" if signum == signal.SIGINT else ""
        _say(
            f"{name} received: stopping after the next optimizer step; a checkpoint is coming{again}"
        )

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
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None else ""
    tell(f"{prefix}nedolm: {message}")


def tell(line: str) -> None:
    """Write ``line`` to stderr, safe inside a signal handler and on a closed stderr.

    os.write, not print or logging: the handler may run inside a write to stderr, where a
    buffered write would raise "reentrant call"; logging's lock may be held mid-record. When
    the reader is gone (a Ctrl-C ended ``| tee`` too) the line is lost, not the run: stdout and
    stderr then point at /dev/null, so no later line, log record or exit-time flush raises
    ``BrokenPipeError`` either; train.log keeps the record.
    """
    try:
        os.write(2, f"{line}\n".encode())
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
