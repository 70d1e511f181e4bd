"""``run(cfg)``: the whole SFT job, as ``nedolm-sft run`` and ``python -m nedolm.train`` start it."""

from __future__ import annotations

import contextlib
import logging
import shutil
import traceback
from collections.abc import Iterator
from pathlib import Path

import msgspec
import torch

from nedolm.dist import (
    DistInfo,
    all_rank_call,
    cleanup,
    main_rank_call,
    raise_if_peers_lost,
    setup_distributed,
    sync_control_flags,
)
from nedolm.train.async_save import StagedCopies
from nedolm.train.checkpoint import checkpoint_step, latest_checkpoint
from nedolm.train.config import SFTConfig
from nedolm.train.loop import Trainer
from nedolm.train.metrics import MetricsWriter, require_sinks, setup_logging
from nedolm.train.run_lock import LOCK_FILE, run_dir_lock
from nedolm.train.setup import Run, prepare_run
from nedolm.train.signals import StopRequest, claim
from nedolm.train.stop_record import left_behind, record_stop

log = logging.getLogger(__name__)


def run(
    cfg: SFTConfig,
    *,
    smoke_steps: int | None = None,
    compile: bool = True,
    stop: StopRequest | None = None,
) -> None:
    """Fine-tune per ``cfg`` in this process (one rank of a torchrun/SLURM job, or alone).

    Rank 0 holds the run directory's lock throughout (``run_lock``). Returns normally when
    the run finished or stopped on request (SIGTERM, SIGUSR1, a first SIGINT, ``max_hours``)
    after writing a checkpoint and, on a stop, the stop record (``stop_record``); a stop agreed
    before the first step (during setup or the compile warm-up) returns without training or
    saving. Raises on any failure, on every rank (naming the lost ranks when peers died); a
    second SIGINT raises ``KeyboardInterrupt`` after logging which checkpoint is left.

    Args:
        smoke_steps: run this many optimizer steps instead of the configured number, in the
            scratch dir ``smoke_run_dir(cfg.run_dir)`` (emptied first), not in the run dir.
        compile: False forces eager mode (``--no-compile``).
        stop: a StopRequest installed earlier; default: the one ``signals.install_early``
            installed before the heavy imports, else one installed now, before anything slow.
    """
    stop = stop or claim()
    if smoke_steps is not None:
        cfg = msgspec.structs.replace(cfg, run_dir=smoke_run_dir(cfg.run_dir))
    require_sinks(cfg.train.report_to)  # a missing extra is named now, not after the setup
    info = setup_distributed()
    try:
        with run_dir_lock(info, cfg.run_dir), _deterministic_on_cpu(info.device):
            _train(cfg, info, stop, smoke_steps=smoke_steps, compile=compile)
    except BaseException as exc:
        _release_frames(exc)  # they would keep the DDP model alive past its process group
        if isinstance(exc, KeyboardInterrupt):
            if info.is_main:
                log.warning("aborted by a second SIGINT: %s", left_behind(cfg.run_dir))
            raise
        raise_if_peers_lost(exc)
        raise
    finally:
        cleanup()  # collects the DDP reducer and loader iterators before the group goes


def _release_frames(exc: BaseException) -> None:
    """Let the training state go while ``exc`` is still being reported (a DDP reducer that
    outlives its gloo group can abort the process at exit: SIGABRT instead of exit 1).

    Clears the local variables of every finished frame ``exc`` holds. The errors under it (a
    rank's failure is raised from its cause, by ``all_rank_call``) also lose their tracebacks:
    a frame keeps its function (Python >= 3.11), and a closure's cells (the trainer's state)
    survive clearing. Their stacks stay readable as a note under the error. Python 3.10 prints
    no notes, and its frames do not hold their function: there the cleared tracebacks stay.
    """
    traceback.clear_frames(exc.__traceback__)
    pending, seen = [exc.__cause__, exc.__context__], {id(exc)}
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        pending += [error.__cause__, error.__context__]
        if error.__traceback__ is None:
            continue
        stack = error.__traceback__
        if hasattr(error, "add_note"):
            text = "".join(traceback.format_tb(stack)).rstrip()
            error.add_note(f"its traceback (most recent call last):\n{text}")
            error.__traceback__ = None
        traceback.clear_frames(stack)


def _train(
    cfg: SFTConfig, info: DistInfo, stop: StopRequest, *, smoke_steps: int | None, compile: bool
) -> None:
    scratch = smoke_steps is not None
    main_rank_call(info, "create run directory", lambda: _make_run_dir(cfg, scratch=scratch))
    setup_logging(cfg.run_dir if info.is_main else None)
    _log_start(cfg, info)
    if _stop_agreed(stop):  # a signal during the imports: do not even read the base
        step = main_rank_call(info, "find latest SFT checkpoint", lambda: _newest_step(cfg))
        _stopped_before_start(cfg, info, stop, step)
        return
    staged = StagedCopies()
    try:
        run_state = prepare_run(
            cfg, info, smoke_steps=smoke_steps, allow_compile=compile, staged=staged
        )
        _train_prepared(cfg, info, stop, run_state)
    finally:  # no pinned allocation may still run when the process group and CUDA go down
        staged.wait_for_reserve()


def _train_prepared(cfg: SFTConfig, info: DistInfo, stop: StopRequest, run_state: Run) -> None:
    if _stop_agreed(stop):  # e.g. during the compile warm-up: no need to train a step first
        _stopped_before_start(cfg, info, stop, run_state.state.progress.step)
        return
    writer = all_rank_call(
        info,
        "open metrics",
        lambda: MetricsWriter(cfg.run_dir, cfg.train.report_to) if info.is_main else None,
    )
    try:
        stopped = Trainer(run_state, stop, writer).train()
    finally:
        if writer is not None:
            writer.close()
    if stopped or cfg.train.save_final_checkpoint:  # a signal may come as training ends
        record_stop(info, cfg.run_dir, run_state.state.progress.step, trained=True)


@contextlib.contextmanager
def _deterministic_on_cpu(device: torch.device) -> Iterator[None]:
    """Torch's deterministic algorithms for a CPU job (restored after), so that compiled runs
    are bitwise reproducible too.

    Without them inductor's CPU kernel for the embedding's backward adds into a row from
    several threads (atomic adds, in whatever order the threads come), and two compiled runs
    with more than one thread differed in the last bits. Eager CPU kernels are deterministic
    either way. Not on CUDA, where the mode needs a cuBLAS workspace setting and refuses some
    of the kernels training uses.
    """
    if device.type != "cpu":
        yield
        return
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True)
    # Training never reads memory it did not write: skip the NaN fill of every new tensor.
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.utils.deterministic.fill_uninitialized_memory = saved[2]


def _stop_agreed(stop: StopRequest) -> bool:
    """Collective: did any rank ask to stop?"""
    return sync_control_flags(rank0_archive_due=False, local_stop=stop.requested)[1]


def _stopped_before_start(cfg: SFTConfig, info: DistInfo, stop: StopRequest, step: int) -> None:
    """End a job that trained no step: nothing new to save, but a stop record for ``launch``."""
    log.warning(
        "stop requested (%s): stopped before step %d; nothing to save", stop.describe(), step + 1
    )
    record_stop(info, cfg.run_dir, step, trained=False)


def _newest_step(cfg: SFTConfig) -> int:
    newest = latest_checkpoint(cfg.run_dir)
    return 0 if newest is None else checkpoint_step(newest)


def smoke_run_dir(run_dir: Path) -> Path:
    """Where ``--smoke-steps`` trains: beside the run dir, so a smoke test never leaves a
    checkpoint that the real run would resume from (or refuse for its other ``max_steps``)."""
    return run_dir.with_name(run_dir.name + ".smoke")


def _make_run_dir(cfg: SFTConfig, *, scratch: bool) -> None:
    """Create the run dir; a scratch (smoke) dir is emptied first, under the lock we hold."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    if scratch:
        for entry in cfg.run_dir.iterdir():
            if entry.name == LOCK_FILE:
                continue
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def _log_start(cfg: SFTConfig, info: DistInfo) -> None:
    log.info(
        "SFT run_dir=%s data_dir=%s world_size=%d device=%s",
        cfg.run_dir,
        cfg.data_dir,
        info.world_size,
        info.device,
    )
