"""Chaos: 20 ``kill -9`` at random instants of a run that checkpoints every step, a quarter of
them inside a checkpoint write, then one flipped byte in the newest checkpoint.

Each kill lands at most about one saved step past the resume point (instants are bounded by the
job's own progress, not by wall time alone), so on a fast machine too the run is still going
when the last kill lands.

After every kill the newest checkpoint must load (never a partial file under its final name),
every restart must resume, the corrupt newest checkpoint must be skipped for the previous one,
and the final weights and losses must equal the uninterrupted reference run's, bitwise.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from nedolm.data.atomic import is_temporary
from nedolm.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint

pytestmark = pytest.mark.slow
KILLS = 20


def _wait_for_a_save_in_progress(job, checkpoints: Path) -> None:
    """Return while a checkpoint's temporary file exists (the job is inside a save)."""
    deadline = time.monotonic() + 120
    while not (checkpoints.is_dir() and any(is_temporary(p) for p in checkpoints.iterdir())):
        assert job.procs[0].poll() is None, job.output()[-3000:]
        assert time.monotonic() < deadline, "no save seen in 120 s"
        time.sleep(0.001)


def _newest_step(run_dir: Path) -> int:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1][0] if checkpoints else 0


def _sleep_until_a_new_checkpoint(job, run_dir: Path, after: int, seconds: float) -> None:
    """Sleep ``seconds``, cut short once this job has saved a step past ``after``."""
    deadline = time.monotonic() + seconds
    while _newest_step(run_dir) <= after and time.monotonic() < deadline:
        assert job.procs[0].poll() is None, job.output()[-3000:]
        time.sleep(0.005)


def test_twenty_random_kills_and_a_flipped_byte_then_same_final_weights(
    harness, reference, make_config
):
    config = make_config(train={"ckpt_interval": 1, "keep_last": 2})
    run_dir = config.with_suffix("")
    rng = random.Random(20260907)
    steps_seen = []
    for kill in range(KILLS):
        resumed_at = _newest_step(run_dir)
        job = harness.Job(config, env={"NEDOLM_TEST_DELAY": "data_fetch=0.1"})
        if kill % 4 == 3:  # inside a save: mid-write, before the rename
            _wait_for_a_save_in_progress(job, run_dir / "checkpoints")
        elif kill % 2:  # anywhere up to the first new save: imports, setup, resume, a step
            _sleep_until_a_new_checkpoint(job, run_dir, resumed_at, rng.uniform(0.2, 4.0))
        else:  # once training runs (startup time varies with machine load): mid-step
            job.wait_for(lambda at=resumed_at: _newest_step(run_dir) > at, "a new checkpoint")
            time.sleep(rng.uniform(0.0, 0.15))  # a step takes >= 0.2 s (2 fetches of 0.1 s)
        job.signal(signal.SIGKILL)
        job.wait(timeout=60)
        latest = latest_checkpoint(run_dir)
        if latest is not None:
            state = load_checkpoint(latest)  # complete and readable, or this raises
            assert state["step"] == max(step for step, _ in list_checkpoints(run_dir))
            steps_seen.append(state["step"])
    assert steps_seen and steps_seen[-1] < harness.MAX_STEPS - 1, "kills never landed mid-run"
    assert steps_seen[-1] >= KILLS // 2, steps_seen  # each mid-step kill followed a new save
    assert steps_seen == sorted(steps_seen)  # no resume ever went backwards

    (previous, _), (_, newest_path) = list_checkpoints(run_dir)[-2:]
    data = bytearray(newest_path.read_bytes())
    data[len(data) // 2] ^= 0x10
    newest_path.write_bytes(bytes(data))
    harness.Job(config).wait_ok()
    log = (run_dir / "train.log").read_text(encoding="utf-8")
    assert f"skipping checkpoint: {newest_path} is corrupt: sha256 " in log
    assert f"resuming from {run_dir / 'checkpoints' / f'step-{previous:08d}.pt'}" in log
    harness.assert_same_weights(harness.final_weights(run_dir), harness.final_weights(reference))
    losses, expected = harness.step_losses(run_dir), harness.step_losses(reference)
    assert losses == expected
