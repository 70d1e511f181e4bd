"""The lifecycle of the loader's DataLoader workers: they die with the trainer, and outlive a
job-wide SIGTERM or Ctrl-C long enough to serve the batches before the stop checkpoint."""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys

import torch


class StopSignalGuard:
    """``worker_init_fn``: workers die with their parent, and ignore SIGTERM and SIGINT until
    the main process exits.

    A worker orphaned by a ``kill -9`` of the trainer would otherwise live on until torch's
    watchdog notices (seconds), using memory and CPU the requeued job needs; on Linux the
    kernel sends it SIGKILL when its parent dies (``PR_SET_PDEATHSIG``). The signal follows the
    *thread* that forked the worker: iterate the loader from a thread that lives as long as
    the loader (the trainer's main thread does).

    A scheduler's SIGTERM (or a terminal's Ctrl-C) reaches every process of the job; the
    workers must keep serving batches while the main process writes its checkpoint. But when
    the main process exits, ``multiprocessing`` ends its daemon workers with SIGTERM and then
    joins them, which would hang forever on a worker that ignores it. So the main process
    raises a shared flag at exit (an ``atexit`` hook registered after multiprocessing's own,
    hence run before it), and a worker whose flag is up exits on SIGTERM.
    """

    def __init__(self) -> None:
        self.exiting = _main_process_exit_flag()

    def __call__(self, _worker_id: int) -> None:
        _die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, _signum: int, _frame: object) -> None:
        if self.exiting[0]:
            os._exit(0)


def worker_start_method() -> str | None:
    """``fork`` on Linux, whatever Python's default: ``StopSignalGuard`` needs the workers to
    be the trainer's children. Under ``forkserver`` (Python 3.14's default there) their parent
    is the fork server, which a job-wide SIGTERM kills, and the workers die with it while the
    trainer still needs batches to reach its stop checkpoint. Elsewhere Python's default (macOS:
    ``spawn``, as fork is unsafe there)."""
    return "fork" if sys.platform.startswith("linux") else None


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """Ask the kernel for SIGKILL when the parent dies (Linux; elsewhere torch's watchdog)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the request: nobody will send it
        os._exit(0)


_EXIT_FLAG: torch.Tensor | None = None


def _main_process_exit_flag() -> torch.Tensor:
    """One shared-memory byte per main process, set to 1 when that process exits."""
    global _EXIT_FLAG
    if _EXIT_FLAG is None:
        _EXIT_FLAG = torch.zeros(1, dtype=torch.uint8).share_memory_()
        atexit.register(_EXIT_FLAG.fill_, 1)
    return _EXIT_FLAG
