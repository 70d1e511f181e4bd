"""Restarts after what schedulers and storage do, in real processes: ``kill -9`` of the trainer
alone while its loader workers live on, checkpoints copied without their sidecars, and a
sharded save killed half-way, resumed under DDP and under FSDP."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest
import torch

from nedolm.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from nedolm.train.testing import process_running

pytestmark = pytest.mark.slow
SLOW_FETCH = {"NEDOLM_TEST_DELAY": "data_fetch=0.15"}  # room to act mid-run; no numeric effect


def _children(pid: int) -> list[int]:
    """Every child of ``pid``, whichever of its threads forked it."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            found += map(int, (task / "children").read_text().split())
    return found


def _assert_matches_reference(harness, run_dir: Path, reference: Path, first_step: int) -> None:
    losses, expected = harness.step_losses(run_dir), harness.step_losses(reference)
    assert sorted(losses) == list(range(first_step, harness.MAX_STEPS + 1))
    assert losses == {step: expected[step] for step in losses}
    harness.assert_same_weights(harness.final_weights(run_dir), harness.final_weights(reference))


def test_kill_9_of_the_trainer_alone_then_an_immediate_restart_resumes_exactly(
    harness, reference, make_config
) -> None:
    """The OOM killer or a node agent kills the trainer, not its process group; the scheduler
    requeues at once. The workers are stopped first: the worst case of workers slow to notice
    their parent's death, which a lock shared with them turned into a refused restart."""
    config = make_config(train={"num_workers": 2, "ckpt_interval": 3})
    job = harness.Job(config, env=SLOW_FETCH)
    job.wait_for_step(8)
    trainer = job.procs[0].pid
    workers = _children(trainer)
    assert len(workers) >= 2, workers
    try:
        for worker in workers:
            os.kill(worker, signal.SIGSTOP)
        os.kill(trainer, signal.SIGKILL)
        job.procs[0].wait(timeout=60)
        restart = harness.Job(config)  # at once
        restart.wait_ok()
    finally:
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
    out = restart.output()
    assert "RunDirLocked" not in out
    dead = f"host {socket.gethostname()} pid {trainer}"
    assert [line for line in out.splitlines() if "taking it over" in line] == [
        f"run_dir {job.run_dir}: its lock names {dead}, which ended without releasing it "
        "(killed?); taking it over"
    ]
    deadline = time.monotonic() + 60
    while any(process_running(worker) for worker in workers):  # they died with the trainer, stopped
        assert time.monotonic() < deadline, [w for w in workers if process_running(w)]
        time.sleep(0.1)
    _assert_matches_reference(harness, job.run_dir, reference, first_step=1)
    lock = (job.run_dir / "run.lock").read_text(encoding="utf-8")
    assert lock == f"released by host {socket.gethostname()} pid {restart.procs[0].pid}\n"


def _flip_a_weight_byte(path: Path) -> None:
    """One flipped bit in the middle of the largest weight: the file still loads."""
    weights = load_checkpoint(path)["model"]
    largest = max(weights.values(), key=torch.Tensor.numel)
    data = bytearray(path.read_bytes())
    offset = bytes(data).find(largest.numpy().tobytes())
    assert offset > 0
    data[offset + largest.numel() * 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_checkpoints_copied_without_sidecars_still_catch_a_flipped_byte(
    harness, reference, make_config
) -> None:
    """``cp checkpoints/*.pt`` into a new run dir, then storage flips a bit in the newest."""
    config = make_config()
    checkpoints = config.with_suffix("") / "checkpoints"
    checkpoints.mkdir(parents=True)
    for _, path in list_checkpoints(reference):
        shutil.copy2(path, checkpoints)
    assert not list(checkpoints.glob("*.sha256"))
    newest = checkpoints / f"step-{harness.MAX_STEPS:08d}.pt"
    _flip_a_weight_byte(newest)
    harness.Job(config).wait_ok()
    log = (config.with_suffix("") / "train.log").read_text(encoding="utf-8")
    assert f"skipping checkpoint: {newest} is corrupt: sha256 " in log
    assert "does not match the digest inside it" in log
    assert f"resuming from {checkpoints / f'step-{harness.EPOCH_STEPS:08d}.pt'}" in log
    _assert_matches_reference(
        harness, config.with_suffix(""), reference, first_step=harness.EPOCH_STEPS + 1
    )


FSDP_RECIPE = {"grad_accum_steps": 1, "max_steps": 6, "ckpt_interval": 2, "keep_last": 5}


def test_a_killed_sharded_save_then_resume_under_ddp_and_under_fsdp(
    harness, make_config, tmp_path
) -> None:
    config = make_config("killed", train={**FSDP_RECIPE, "parallelism": "fsdp"})
    run_dir = config.with_suffix("")
    first = harness.Job(config, world_size=2, env=SLOW_FETCH)
    first.wait_for_log("sharded checkpoint written: ")  # step 2, complete
    first.signal(signal.SIGKILL)
    first.wait()
    assert [step for step, _ in list_checkpoints(run_dir)] == [2]
    # The next save (step 4) stalls after every shard is on disk, before manifest and rename.
    stalled = harness.Job(config, world_size=2, env={"NEDOLM_TEST_DELAY": "sharded_finish=600"})
    stray = run_dir / "checkpoints" / ".step-00000004.tmp-dcp"
    stalled.wait_for(lambda: (stray / ".metadata").exists(), "the shards of step 4")
    stalled.signal(signal.SIGKILL)
    stalled.wait()
    assert latest_checkpoint(run_dir).name == "step-00000002"

    losses = {}
    for mode in ("ddp", "fsdp"):
        copy = tmp_path / mode
        shutil.copytree(run_dir / "checkpoints", copy / "checkpoints")  # stray included
        resumed = make_config(mode, train={**FSDP_RECIPE, "parallelism": mode})
        job = harness.Job(resumed, world_size=2)
        job.wait_ok()
        assert not (copy / "checkpoints" / stray.name).exists()
        assert [step for step, _ in list_checkpoints(copy)] == [2, 4, 6]
        log = (copy / "train.log").read_text(encoding="utf-8")
        assert f"resuming from {copy / 'checkpoints' / 'step-00000002'} at step 2" in log
        losses[mode] = harness.step_losses(copy)
    assert sorted(losses["ddp"]) == sorted(losses["fsdp"]) == [3, 4, 5, 6]
    for step, loss in losses["ddp"].items():
        assert losses["fsdp"][step] == pytest.approx(loss, rel=1e-6), step
