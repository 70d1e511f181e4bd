"""The training loop, in torchtitan's shape: ``Trainer.train()`` -> ``train_step()`` (step.py)
-> ``forward_backward()``; after each step it logs, validates, agrees on stop/archive and
checkpoints as due.

Control flow that depends on anything rank-local (a signal, the wall clock) is agreed on by
every rank before anyone acts, so every rank takes the same branch. A stop request
(SIGTERM/SIGUSR1/Ctrl-C, ``max_hours``) rides the all-reduce that every optimizer step already
makes (``train_step``'s fetch), so it is honoured after the next optimizer step at no extra
collective. The archive clock (rank 0's) is agreed on at control points: every
``control_interval`` steps, at every checkpoint step and at the last step
(``sync_control_flags``, which also catches a stop requested during the last step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from nedolm.dist import all_rank_call, gather_object, main_rank_call, sync_control_flags
from nedolm.train.async_save import BackgroundWrite
from nedolm.train.checkpoint import (
    CheckpointError,
    checkpoint_path,
    remove_stale_temporaries,
    rotate_checkpoints,
    save_checkpoint,
    save_model_archive,
)
from nedolm.train.compile_cache import save_compile_cache
from nedolm.train.config import to_builtins
from nedolm.train.contract import fingerprint
from nedolm.train.faults import maybe_inject
from nedolm.train.flops import flops_per_token, peak_bf16_flops
from nedolm.train.metrics import MetricsWriter, format_eta
from nedolm.train.optim import lr_at_step, set_lr
from nedolm.train.parallel import is_sharded
from nedolm.train.profiling import StepProfiler, profile_window
from nedolm.train.setup import Run
from nedolm.train.sharded import ShardedSave, full_model_state, sharded_background
from nedolm.train.signals import StopRequest
from nedolm.train.step import LossWindow, StepResult, train_step
from nedolm.train.validation import run_validation

log = logging.getLogger(__name__)


class Trainer:
    """Trains ``run`` from its current step to ``max_steps`` or until a stop request."""

    def __init__(self, run: Run, stop: StopRequest, writer: MetricsWriter | None) -> None:
        self.run = run
        self.state = run.state
        self.stop = stop
        self.writer = writer  # rank 0 only
        t = run.cfg.train
        self.tokens_per_step = (
            t.micro_batch_size * t.grad_accum_steps * run.info.world_size * run.seq_len
        )
        self.params = [p for p in run.state.model.parameters() if p.requires_grad]
        self.peak_flops = _cluster_peak_flops(run.info.device, run.info.world_size)
        self.flops_per_token = flops_per_token(run.state.model.cfg, run.seq_len)
        self.job_start = time.monotonic()
        self.last_archive = time.monotonic()
        self.first_step = run.state.progress.step
        self.keeps_compile_cache = (
            t.compile_cache and run.contract["execution"]["effective_compile"]
        )
        self.background = BackgroundWrite()  # rank 0's checkpoint write in flight, if any
        self.staged = run.staged
        self.async_save = t.async_checkpoint
        self.sharded = is_sharded(run.state.model)
        self.sharded_background = (
            sharded_background(run.info.device) if self.async_save and self.sharded else None
        )
        self.sharded_save: ShardedSave | None = None  # every rank's, under FSDP
        self.pending: tuple[int, float] | None = None
        """(step, training pause in s) of the background write not yet collected, every rank."""
        profile = run.cfg.profile
        self.profiler = StepProfiler(
            profile_window(profile.start_step, profile.steps, run.max_steps),
            run.cfg.run_dir,
            run.info.rank,
            run.info.device,
            resumed_at=run.state.progress.step,
        )
        self._reset_log_window()

    def train(self) -> bool:
        """The whole loop; returns normally on completion (False) and on a stop request (True)."""
        run, progress = self.run, self.state.progress
        at_start = run.cfg.validation.at_start and progress.step == 0  # not again on resume
        if run.val_loader is not None and at_start:
            self.validate()
        log.info("training steps %d -> %d", progress.step, run.max_steps)
        run.model.train()
        self._reset_log_window()
        self.stop.training = True  # a stop from now on is answered with a checkpoint
        try:
            if self._train_steps():
                return True
        finally:
            with self._untimed():
                self.profiler.close()  # a window cut short is written with the steps it holds
        log.info(
            "finished at step %d: %d assistant tokens, %.2f h",
            progress.step,
            progress.assistant_tokens_seen,
            (time.monotonic() - self.job_start) / 3600,
        )
        return False

    def _train_steps(self) -> bool:
        """The optimizer steps; True when they end on an agreed stop request."""
        run, progress = self.run, self.state.progress
        for step in range(progress.step, run.max_steps):
            lr = lr_at_step(step, run.cfg.optim, progress.schedule_steps or run.max_steps)
            set_lr(self.state.optimizer, lr)
            done = step + 1
            self.loss_window.read_now = done % run.cfg.train.log_interval == 0 or done in (
                self.first_step + 1,
                run.max_steps,
            )
            with self._untimed():  # starting the profiler is not the step's time
                self.profiler.before_step(done)
            result = train_step(
                run.model,
                self.params,
                self.state.optimizer,
                run.train_batches,
                run.settings,
                step,
                local_stop=self._local_stop(),
                loss_window=self.loss_window,
            )
            self._account(done, result)
            if done == self.first_step + 1 and self.keeps_compile_cache and run.info.is_main:
                with self._untimed():  # every graph of the run is compiled by now
                    save_compile_cache(run.cfg.run_dir)
            with self._untimed():  # nor is writing its files
                self.profiler.after_step(done, last=result.stop)
            if run.audit is not None:
                run.audit.write_step(done, result.global_targets)
            if self.loss_window.read_now:
                self.log_step(lr)
            if run.val_loader is not None and (
                done % run.cfg.validation.interval == 0 or done == run.max_steps
            ):
                self.validate()
            if self.control(done, stop_agreed=result.stop):
                log.warning("stop requested (%s): stopped at step %d", self.stop.describe(), done)
                return True
        return False

    def _account(self, done: int, result: StepResult) -> None:
        """Progress and the log window after optimizer step ``done`` (1-based)."""
        progress = self.state.progress
        progress.step = done
        progress.context_tokens_seen += self.tokens_per_step
        progress.assistant_tokens_seen += result.global_targets
        self.grad_norm = result.grad_norm
        self.window_targets += result.global_targets
        self.window_steps += 1

    def log_step(self, lr: float) -> None:
        """The log line of the steps since the last one; their loss was read by the last step
        (``LossWindow``), so nothing here waits for the device, which is still running that
        step's AdamW. The window's time is taken at the same point of every step, so it is the
        steps' time."""
        run = self.run
        assert self.loss_window.value is not None  # read by the step that ends the window
        loss = self.loss_window.value / self.window_targets
        elapsed = time.monotonic() - self.window_start
        sec_per_step = elapsed / self.window_steps
        done = self.state.progress.step
        record = {
            "step": done,
            "epoch": done / run.steps_per_epoch,
            "loss": loss,
            "ppl": math.exp(min(20.0, loss)),
            "lr": lr,
            "grad_norm": self.grad_norm,
            "tokens_per_s": self.tokens_per_step / sec_per_step,
            "sec_per_step": sec_per_step,
            "assistant_ratio": self.window_targets / (self.tokens_per_step * self.window_steps),
            "context_tokens_seen": self.state.progress.context_tokens_seen,
            "assistant_tokens_seen": self.state.progress.assistant_tokens_seen,
            "hours": (time.monotonic() - self.job_start) / 3600,
        }
        if run.info.device.type == "cuda":
            # This rank's peak since the window began (``_reset_log_window``).
            record["peak_mem_gib"] = torch.cuda.max_memory_allocated(run.info.device) / 2**30
        if self.peak_flops:
            record["mfu"] = record["tokens_per_s"] * self.flops_per_token / self.peak_flops
        eta = format_eta(sec_per_step * (run.max_steps - done))

        def write() -> None:
            assert self.writer is not None  # rank 0 owns the writer
            self.writer.write(record)
            mfu = f" mfu {100 * record['mfu']:.1f}%" if "mfu" in record else ""
            memory = f" mem {record['peak_mem_gib']:.1f}GiB" if "peak_mem_gib" in record else ""
            log.info(
                "step %d/%d epoch %.2f loss %.4f lr %.3e gn %.3f %.0f tok/s%s%s eta %s",
                done,
                run.max_steps,
                record["epoch"],
                loss,
                lr,
                record["grad_norm"],
                record["tokens_per_s"],
                mfu,
                memory,
                eta,
            )

        main_rank_call(run.info, f"log metrics at step {done}", write)
        self._reset_log_window()

    def validate(self) -> None:
        """A validation pass, logged as ``{"kind": "validation", "val_loss": ...}``."""
        with self._untimed():
            self._validate()

    def _validate(self) -> None:
        run = self.run
        step = self.state.progress.step
        log.info("validating at step %d", step)
        result = run_validation(
            self.state.model,
            run.val_loader,
            run.info,
            batches=run.cfg.validation.batches,
            eos_id=run.eos_id,
            options=run.settings.loss,
            sources=run.val_sources,
            memory=run.settings.memory,
        )
        record = {
            "step": step,
            "kind": "validation",
            "val_loss": result.loss,
            "val_ppl": result.ppl,
            "val_assistant_tokens": result.targets,
            "val_context_tokens": result.context_tokens,
        }
        if result.loss_by_source:  # a corpus with validation inputs (prepare --val-input)
            record["val_loss_by_source"] = result.loss_by_source
            record["val_assistant_tokens_by_source"] = result.targets_by_source

        def write() -> None:
            assert self.writer is not None
            self.writer.write(record)
            log.info("validation at step %d: loss %.4f ppl %.2f", step, result.loss, result.ppl)

        main_rank_call(run.info, f"log validation at step {step}", write)

    def _local_stop(self) -> bool:
        """This rank's stop request: a signal, or the ``max_hours`` limit reached."""
        max_hours = self.run.cfg.train.max_hours
        if max_hours > 0 and (time.monotonic() - self.job_start) / 3600 >= max_hours:
            self.stop.request("max_hours")
        return self.stop.requested

    def control(self, done: int, *, stop_agreed: bool) -> bool:
        """Checkpoint on an agreed stop and as due; agree on the archive at control points.
        Returns True to stop now."""
        run, t = self.run, self.run.cfg.train
        is_last = done == run.max_steps
        stop, archive = stop_agreed, False
        at_control_point = done % t.control_interval == 0 or done % t.ckpt_interval == 0
        if not stop and (at_control_point or is_last):
            archive_due = (
                t.archive_interval_hours > 0
                and (time.monotonic() - self.last_archive) / 3600 >= t.archive_interval_hours
            )
            archive, stop = sync_control_flags(
                rank0_archive_due=archive_due, local_stop=self._local_stop()
            )
        if at_control_point or is_last:  # a failed background write stops every rank here
            self.collect_background_write(block=is_last)
        if not (stop or archive or done % t.ckpt_interval == 0 or is_last):
            return False
        with self._untimed():
            if archive:
                self.save_archive()
            if stop or done % t.ckpt_interval == 0 or (is_last and t.save_final_checkpoint):
                self.save_checkpoint(wait=stop or is_last)
        return stop

    def save_checkpoint(self, *, wait: bool = False) -> None:
        """Gather every rank's RNG and loader cursor, then rank 0 writes one atomic file
        (under FSDP: every rank writes its shards into one atomic directory).

        With ``train.async_checkpoint`` rank 0 copies the state to CPU memory and writes it in
        the background while training goes on; the previous background write is waited for
        first (one in flight at most), and ``wait`` (a stop, the last step) waits for this one.
        """
        run, state = self.run, self.state
        done = state.progress.step
        started = time.monotonic()
        self.collect_background_write(block=True)
        log.info("writing checkpoint at step %d", done)

        def rank_state() -> dict:
            maybe_inject("checkpoint_write", run.info.rank)
            return state.rank_state_dict()

        local = all_rank_call(run.info, f"prepare checkpoint at step {done}", rank_state)
        ranks = gather_object(local)
        t = run.cfg.train
        extra = {
            "step": done,
            "contract": run.contract,
            "fingerprints": {k: fingerprint(v) for k, v in run.contract.items()},
            "base_checkpoint": run.base_checkpoint,
            "sft_config": to_builtins(run.cfg),
        }
        if self.sharded:
            main_rank_call(
                run.info,
                f"remove stale temporaries at step {done}",
                lambda: remove_stale_temporaries(run.cfg.run_dir),
            )
            self.sharded_save = state.start_sharded_save(
                checkpoint_path(run.cfg.run_dir, done).with_suffix(""),
                ranks,
                extra,
                background=self.sharded_background,
            )
            self.pending = (done, time.monotonic() - started)
            if wait or self.sharded_background is None:
                self.collect_background_write(block=True)
            return

        def write(payload: dict) -> None:
            path = save_checkpoint(
                run.cfg.run_dir, done, payload, keep_last=t.keep_last, keep_every=t.keep_every
            )
            log.info("checkpoint written: %s", path)

        if not self.async_save:
            main_rank_call(
                run.info,
                f"write checkpoint at step {done}",
                lambda: write({**extra, **state.state_dict(ranks)}),
            )
            self._log_sync_save(done, started)
            return

        def stage_and_submit() -> None:
            payload = self.staged.stage({**extra, **state.state_dict(ranks)})
            path = checkpoint_path(run.cfg.run_dir, done)
            self.background.submit(path.name, lambda: _write_named(write, payload, path))

        main_rank_call(run.info, f"stage checkpoint at step {done}", stage_and_submit)
        self.pending = (done, time.monotonic() - started)
        if wait:
            self.collect_background_write(block=True)

    def collect_background_write(self, *, block: bool) -> None:
        """Rank 0's background write, once it has ended (``block``: wait for it): its times
        go to the log and metrics; its failure is raised on every rank, naming the file."""
        if self.pending is None:
            return
        step, pause = self.pending
        if self.sharded_save is not None:
            self._collect_sharded_save(step, pause, block=block)
            return

        def collect() -> bool:
            if not (block or self.background.finished()):
                return False
            self._log_save(step, pause, self.background.collect())
            return True

        if main_rank_call(self.run.info, f"write checkpoint at step {step}", collect):
            self.pending = None

    def _collect_sharded_save(self, step: int, pause: float, *, block: bool) -> None:
        """Every rank: once rank 0 has sealed the directory (``block``: wait for it), rotate and
        log; a failed write is raised on every rank. A save written in the step (no background
        group) paused training for all of it."""
        save, run, t = self.sharded_save, self.run, self.run.cfg.train
        assert save is not None
        if not (block or main_rank_call(run.info, f"check checkpoint at step {step}", save.done)):
            return
        started = time.monotonic()
        path = save.finish()
        main_rank_call(
            run.info,
            f"rotate checkpoints at step {step}",
            lambda: rotate_checkpoints(run.cfg.run_dir, step, t.keep_last, t.keep_every),
        )
        log.info("sharded checkpoint written: %s", path)
        if save.write_s is None:
            pause += time.monotonic() - started
        main_rank_call(
            run.info, "log checkpoint", lambda: self._log_save(step, pause, save.write_s)
        )
        self.pending = self.sharded_save = None

    def _log_sync_save(self, step: int, started: float) -> None:
        elapsed = time.monotonic() - started
        main_rank_call(self.run.info, "log checkpoint", lambda: self._log_save(step, elapsed, None))

    def _log_save(self, step: int, pause_s: float, write_s: float | None) -> None:
        """Rank 0: ``{"kind": "checkpoint", "pause_s", "write_s"}``; a synchronous save's write
        is its pause (``write_s`` None)."""
        background = write_s is not None
        record = {
            "step": step,
            "kind": "checkpoint",
            "pause_s": pause_s,
            "write_s": write_s if background else pause_s,
            "background": background,
        }
        if self.writer is not None:
            self.writer.write(record)
        log.info(
            "checkpoint at step %d: training paused %.2f s, written in %.2f s%s",
            step,
            pause_s,
            record["write_s"],
            " (in the background)" if background else "",
        )

    def save_archive(self) -> None:
        """Weights and provenance only, for shipping or evaluating a snapshot."""
        run, state = self.run, self.state
        done = state.progress.step
        self.collect_background_write(block=True)  # not two writes of the state at once
        weights = full_model_state(state.model)  # a collective under FSDP; rank 0 holds it

        def write() -> None:
            payload = {
                "step": done,
                "model": weights,
                "model_config": run.contract["training"]["recipe"]["model_config"],
                "eos_id": run.eos_id,
                "progress": dataclasses.asdict(state.progress),
                "fingerprints": {k: fingerprint(v) for k, v in run.contract.items()},
                "base_checkpoint": run.base_checkpoint,
            }
            log.info("archive written: %s", save_model_archive(run.cfg.run_dir, done, payload))

        main_rank_call(run.info, f"write archive at step {done}", write)
        self.last_archive = time.monotonic()

    @contextlib.contextmanager
    def _untimed(self) -> Iterator[None]:
        """Keep validation and checkpoint time out of the throughput figure."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.window_start += time.monotonic() - started

    def _reset_log_window(self) -> None:
        self.loss_window = LossWindow(self.run.info.device)
        self.window_targets = 0
        self.window_steps = 0
        self.window_start = time.monotonic()
        if self.run.info.device.type == "cuda":  # a line shows what its own steps need, not
            torch.cuda.reset_peak_memory_stats(self.run.info.device)  # the warm-up's high mark


def _write_named(write: Callable[[dict], None], payload: dict, path: Path) -> None:
    """``write(payload)``, a failure re-raised as a CheckpointError naming the file (a disk-full
    error already does): a background failure surfaces steps later, far from its cause."""
    try:
        write(payload)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"cannot write checkpoint {path}: {type(exc).__name__}: {exc}; "
            "the previous checkpoints are intact"
        ) from exc


def _cluster_peak_flops(device: torch.device, world_size: int) -> float | None:
    """The job's bf16 peak (every rank's device alike), or None off CUDA or for a device the
    table does not know (logged once): MFU is then left out rather than guessed."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = peak_bf16_flops(name)
    if peak is None:
        log.info("MFU not reported: no bf16 peak known for %s", name)
        return None
    return peak * world_size
