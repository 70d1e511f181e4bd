"""Faults under plain torchrun (``python -m torch.distributed.run``, 2 gloo ranks): a rank
killed mid-step is named by its survivor, and a SIGTERM to torchrun stops every rank on one
consistent checkpoint with its stop record, though torchrun itself exits 1. ``nedolm-sft
launch`` turns that clean stop into exit 0 and is tested, with the exact resume, in the app."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from nedolm.train.checkpoint import list_checkpoints, load_checkpoint
from nedolm.train.stop_record import STOP_RECORD
from nedolm.train.testing import STOP_TEST_MAX_STEPS, LaunchedJob

pytestmark = pytest.mark.slow
COLLECTIVE_TIMEOUT_S = 30
SLOW_FETCH = {"NEDOLM_TEST_DELAY": "data_fetch=0.3"}  # room to act mid-run; no numeric effect


def torchrun(config: Path, nproc: int = 2, env: dict[str, str] | None = None) -> LaunchedJob:
    """``torchrun --standalone --nproc_per_node N -m nedolm.train CONFIG``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node", str(nproc), "-m", "nedolm.train", str(config)]
    timeout = {"NEDOLM_DIST_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S)}
    return LaunchedJob(cmd, config, {**timeout, **(env or {})})


def test_a_rank_killed_mid_step_is_named_by_the_survivor(make_config) -> None:
    config = make_config("killed", train={"grad_accum_steps": 1, "max_steps": 40})
    job = torchrun(config, env=SLOW_FETCH)
    job.wait_for_step(2)
    os.kill(job.rank_pid(1), signal.SIGKILL)
    killed = time.monotonic()
    assert job.wait() != 0
    assert time.monotonic() - killed < COLLECTIVE_TIMEOUT_S
    assert "rank 0: lost rank 1 (no answer within 5 s" in job.output(), job.output()[-4000:]


def test_sigterm_to_torchrun_stops_every_rank_on_one_checkpoint_but_torchrun_exits_1(
    make_config,
) -> None:
    # Steps to spare: the job ends on its own only if this test stalls ~10 s after step 3.
    config = make_config("stopped", train={"grad_accum_steps": 1, "max_steps": STOP_TEST_MAX_STEPS})
    job = torchrun(config, env=SLOW_FETCH)
    job.wait_for_step(3)
    os.kill(job.proc.pid, signal.SIGTERM)  # torchrun itself, as a scheduler would
    signalled = time.monotonic()
    code = job.wait()
    out = job.output()
    # torchrun forwards SIGTERM to the workers, waits up to 30 s for them (then SIGKILLs) and
    # exits 1 with its own SignalException: that status is torchrun's, not the job's.
    assert code == 1 and "SignalException: Process" in out, out[-4000:]
    assert time.monotonic() - signalled < 25, "the ranks did not exit on their own"
    [(step, path)] = list_checkpoints(job.run_dir)
    for rank in (0, 1):  # every rank agreed on the same stop step, then returned normally
        assert f"[rank {rank}] WARNING stop requested (SIGTERM): stopped at step {step}" in out
    state = load_checkpoint(path)
    assert 3 <= step < STOP_TEST_MAX_STEPS and len(state["ranks"]) == 2
    assert state["progress"]["step"] == step
    record = json.loads((job.run_dir / STOP_RECORD).read_text(encoding="utf-8"))
    assert record == {"step": step, "trained": True, "world_size": 2, "launch_ids": [""]}

    single = torchrun(config, nproc=1)  # another world size: refused, naming both
    assert single.wait() != 0
    assert "execution.world_size: checkpoint 2 != now 1" in single.output()
