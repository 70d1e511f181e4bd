"""Exact resume in real processes: SIGTERM, kill -9, the epoch boundary, loader workers.

Every run is compared with one uninterrupted reference run of the same recipe: per-step losses
and final weights must be bitwise equal. Cadence settings (checkpoint/log intervals, workers)
are not part of the recipe; the loader's batch order does not depend on its worker count.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from nedolm.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from nedolm.train.testing import caught_signals

pytestmark = pytest.mark.slow
SLOW_FETCH = {"NEDOLM_TEST_DELAY": "data_fetch=0.15"}  # room to signal mid-run; no numeric effect


def _assert_matches_reference(
    harness: SimpleNamespace, run_dir: Path, reference: Path, first_step: int = 1
) -> None:
    losses, expected = harness.step_losses(run_dir), harness.step_losses(reference)
    assert sorted(losses) == list(range(first_step, harness.MAX_STEPS + 1))
    assert losses == {step: expected[step] for step in losses}
    harness.assert_same_weights(harness.final_weights(run_dir), harness.final_weights(reference))


def test_sigterm_then_resume_is_bitwise_exact(harness, reference, make_config) -> None:
    config = make_config()
    job = harness.Job(config, env=SLOW_FETCH)
    job.wait_for_step(4)
    job.signal(signal.SIGTERM)
    job.wait_ok()
    stopped = load_checkpoint(latest_checkpoint(job.run_dir))["step"]
    assert 4 <= stopped < harness.MAX_STEPS
    assert "stop requested (SIGTERM)" in (job.run_dir / "train.log").read_text(encoding="utf-8")
    harness.Job(config).wait_ok()
    _assert_matches_reference(harness, job.run_dir, reference)


def test_kill_9_then_resume_from_last_checkpoint_is_bitwise_exact(
    harness, reference, make_config
) -> None:
    config = make_config(train={"ckpt_interval": 3})
    job = harness.Job(config, env=SLOW_FETCH)
    job.wait_for_step(8)
    logged = job.kill_9_frozen()
    job.wait()
    resumed_from = load_checkpoint(latest_checkpoint(job.run_dir))["step"]
    assert resumed_from in harness.left_by_kill_9(logged, 3)
    harness.Job(config).wait_ok()
    _assert_matches_reference(harness, job.run_dir, reference)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_exactly_at_the_epoch_boundary(
    harness, reference, make_config, num_workers: int
) -> None:
    """The checkpoint after the epoch's last step: the next epoch is neither skipped nor replayed."""
    config = make_config(train={"num_workers": num_workers})
    run_dir = config.with_suffix("")
    harness.copy_checkpoint(reference, harness.EPOCH_STEPS, into=run_dir)
    state = load_checkpoint(latest_checkpoint(run_dir))
    (cursor,) = state["ranks"][0]["loader"].values()
    assert (cursor[1], cursor[2]) == (1, 0)  # epoch 1, cursor 0: exactly at the boundary
    if num_workers:  # the checkpoint was written with 0 workers: a changed topology is refused
        job = harness.Job(config)
        assert job.wait() == [1]
        assert "execution.num_workers: checkpoint 0 != now 2" in job.output()
        return
    harness.Job(config).wait_ok()
    _assert_matches_reference(harness, run_dir, reference, first_step=harness.EPOCH_STEPS + 1)


FORKSERVER_DEFAULT = Path(__file__).with_name("forkserver_default")  # Python 3.14's default


@pytest.mark.parametrize("forkserver_default", [False, True], ids=["as-installed", "forkserver"])
def test_sigterm_with_loader_workers_resumes_exactly(
    harness, reference, make_config, forkserver_default: bool
) -> None:
    """Workers ignore SIGTERM sent to the whole process group, so the main process saves,
    whatever Python's default start method."""
    config = make_config(train={"num_workers": 2})
    env = dict(SLOW_FETCH)
    if forkserver_default:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(FORKSERVER_DEFAULT), os.environ.get("PYTHONPATH")])
        )
    job = harness.Job(config, env=env)
    job.wait_for_step(harness.EPOCH_STEPS - 2)  # resume across the epoch boundary
    job.signal(signal.SIGTERM)
    job.wait_ok()
    harness.Job(config).wait_ok()
    _assert_matches_reference(harness, job.run_dir, reference)


@pytest.mark.parametrize(
    ("phase", "log_line", "settings"),
    [
        ("validation", "validating at step 10", {"train": {"num_workers": 2}}),
        ("checkpoint_write", "writing checkpoint at step 6", {"train": {"ckpt_interval": 6}}),
    ],
)
def test_sigterm_inside_a_phase_still_checkpoints_and_resumes(
    harness, reference, make_config, phase: str, log_line: str, settings: dict
) -> None:
    config = make_config(**settings)
    job = harness.Job(config, env={"NEDOLM_TEST_DELAY": f"{phase}=3"})
    job.wait_for_log(log_line)
    job.signal(signal.SIGTERM)
    job.wait_ok()
    stopped = load_checkpoint(latest_checkpoint(job.run_dir))["step"]
    assert stopped < harness.MAX_STEPS
    harness.Job(config).wait_ok()
    _assert_matches_reference(harness, job.run_dir, reference)


STOPPED_BEFORE_STEP_1 = "stop requested (SIGTERM): stopped before step 1; nothing to save"


def test_sigterm_during_compile_warmup_exits_0_before_step_1(harness, make_config) -> None:
    config = make_config(train={"compile": True, "max_steps": 3})
    job = harness.Job(config, env={"NEDOLM_TEST_DELAY": "compile_warmup=3"})
    job.wait_for_log("compile warm-up started")
    job.signal(signal.SIGTERM)
    job.wait_ok()
    assert list_checkpoints(job.run_dir) == [] and harness.logged_step(job.run_dir) == 0
    log = (job.run_dir / "train.log").read_text(encoding="utf-8")
    assert "compile warm-up done" in log and STOPPED_BEFORE_STEP_1 in log


def test_sigterm_during_startup_imports_is_kept(harness, make_config) -> None:
    """`python -m nedolm.train` installs its handlers before importing torch."""
    config = make_config(train={"max_steps": 3})
    job = harness.Job(config)
    # Handled from ~50 ms after exec; torch and the model then import for seconds.
    job.wait_for(lambda: signal.SIGTERM in caught_signals(job.procs[0].pid), "a SIGTERM handler")
    job.signal(signal.SIGTERM)
    job.wait_ok()
    assert list_checkpoints(job.run_dir) == [] and harness.logged_step(job.run_dir) == 0
    assert STOPPED_BEFORE_STEP_1 in (job.run_dir / "train.log").read_text(encoding="utf-8")
