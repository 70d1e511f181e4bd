"""Chaos: 20 ``kill -9`` at random instants of a run that checkpoints every step.

After every kill the newest checkpoint must load (never a partial file), every restart must
resume, and the final weights must equal the uninterrupted reference run's, bitwise.
"""

from __future__ import annotations

import random
import signal
import time

import pytest

from nedolm.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint

pytestmark = pytest.mark.slow
KILLS = 20


def test_twenty_random_kills_then_same_final_weights(harness, reference, make_config):
    config = make_config(train={"ckpt_interval": 1, "keep_last": 2})
    rng = random.Random(20260907)
    steps_seen = []
    for kill in range(KILLS):
        job = harness.Job(config, env={"NEDOLM_TEST_DELAY": "data_fetch=0.05"})
        if kill % 2:  # anywhere: imports, setup, validation, a step
            time.sleep(rng.uniform(0.2, 4.0))
        else:  # once training runs (startup time varies with machine load): mid-step or mid-write
            job.wait_for_step(harness.logged_step(job.run_dir) + 1)
            time.sleep(rng.uniform(0.0, 0.3))
        job.signal(signal.SIGKILL)
        job.wait(timeout=60)
        latest = latest_checkpoint(job.run_dir)
        if latest is not None:
            state = load_checkpoint(latest)  # complete and readable, or this raises
            assert state["step"] == max(step for step, _ in list_checkpoints(job.run_dir))
            steps_seen.append(state["step"])
    harness.Job(config).wait_ok()
    assert steps_seen and steps_seen[-1] < harness.MAX_STEPS, "kills never landed mid-run"
    assert steps_seen == sorted(steps_seen)  # no resume ever went backwards
    harness.assert_same_weights(
        harness.final_weights(config.with_suffix("")), harness.final_weights(reference)
    )
    losses, expected = harness.step_losses(config.with_suffix("")), harness.step_losses(reference)
    assert losses == expected
