"""Asynchronous checkpoints in real processes: kills and stops while a checkpoint is written in
the background, a failing background write, and a resumed job that keeps nothing of the
checkpoint it resumed from once rotation deleted it.

Background writes are made slow and observable by the test hook ``checkpoint_commit`` (the file
is written under its temporary name, not yet renamed; ``nedolm.train.faults``), so training
visibly goes on while the write is in flight.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from nedolm.data.atomic import is_temporary
from nedolm.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from nedolm.train.metrics import read_metrics

pytestmark = pytest.mark.slow
KILLS = 10


def _temporaries(run_dir: Path, pid: int | None = None) -> list[Path]:
    """Temporary files in checkpoints/ (of process ``pid`` only, when given)."""
    directory = run_dir / "checkpoints"
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if is_temporary(p)]
    return [p for p in found if pid is None or p.name.endswith(f".tmp-{pid}")]


def _writing(run_dir: Path, pid: int) -> int:
    """The step whose checkpoint process ``pid`` is writing now (0: none)."""
    names = [p.name for p in _temporaries(run_dir, pid) if p.name.startswith(".step-")]
    return max([0] + [int(name[len(".step-") :][:8]) for name in names])


def _newest_step(run_dir: Path) -> int:
    found = list_checkpoints(run_dir)
    return found[-1][0] if found else 0


def test_kill_9_during_background_writes_then_resume_is_bitwise_exact(
    harness, reference, make_config
) -> None:
    config = make_config(train={"ckpt_interval": 1, "keep_last": 2})
    run_dir = config.with_suffix("")
    slow_write = {"NEDOLM_TEST_DELAY": "data_fetch=0.05,checkpoint_commit=0.4"}
    rng = random.Random(25)
    mid_write_kills, steps_seen = 0, []
    for _ in range(3 * KILLS):
        if mid_write_kills == KILLS:
            break
        # Inside the write of a step 1-3 past the resume point: the earlier ones completed.
        target = _newest_step(run_dir) + rng.randint(1, 3)
        job = harness.Job(config, env=slow_write)
        pid = job.procs[0].pid  # earlier jobs' temporaries stay until this one's first save
        job.wait_for(
            lambda pid=pid, target=target: _writing(run_dir, pid) >= target, "a background write"
        )
        time.sleep(rng.uniform(0.0, 0.3))  # somewhere inside the 0.4 s write
        job.signal(signal.SIGKILL)
        job.wait(timeout=60)
        mid_write_kills += bool(_temporaries(run_dir, pid))  # the kill cut a write short
        latest = latest_checkpoint(run_dir)
        if latest is not None:
            state = load_checkpoint(latest)  # complete and verified, or this raises
            assert state["step"] == _newest_step(run_dir)
            steps_seen.append(state["step"])
    assert mid_write_kills == KILLS
    assert steps_seen == sorted(steps_seen) and 0 < steps_seen[-1] < harness.MAX_STEPS
    harness.Job(config).wait_ok()
    harness.assert_same_weights(harness.final_weights(run_dir), harness.final_weights(reference))
    assert harness.step_losses(run_dir) == harness.step_losses(reference)


def test_sigterm_during_a_background_write_completes_it_then_saves_the_stop_and_exits_0(
    harness, make_config
) -> None:
    config = make_config(train={"ckpt_interval": 3, "keep_last": 5})
    env = {"NEDOLM_TEST_DELAY": "data_fetch=0.1,checkpoint_commit=3"}
    job = harness.Job(config, env=env)
    run_dir = job.run_dir
    job.wait_for(lambda: bool(_temporaries(run_dir)), "the background write of step 3")
    job.wait_for_step(4)  # training went on while step 3 was being written
    assert _temporaries(run_dir) and list_checkpoints(run_dir) == []
    job.signal(signal.SIGTERM)
    job.wait_ok()
    found = list_checkpoints(run_dir)
    stopped = found[-1][0]
    assert found[0][0] == 3 and stopped >= 4
    for step, path in found:
        assert load_checkpoint(path)["step"] == step
    assert not _temporaries(run_dir)
    log = (run_dir / "train.log").read_text(encoding="utf-8")
    assert f"stop requested (SIGTERM): stopped at step {stopped}" in log
    assert log.index("checkpoint at step 3: training paused") < log.index(
        f"writing checkpoint at step {stopped}"
    )


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("fails_after_s", [0, 2], ids=["fails-at-once", "fails-after-2s"])
def test_a_failed_background_write_stops_every_rank_naming_the_file(
    harness, make_config, world_size: int, fails_after_s: int
) -> None:
    config = make_config(train={"ckpt_interval": 3})
    fault = {
        "NEDOLM_TEST_FAULT": "checkpoint_commit@0",
        "NEDOLM_TEST_DELAY": f"checkpoint_commit={fails_after_s}",
    }
    job = harness.Job(config, world_size=world_size, env=fault)
    assert job.wait() == [1] * world_size
    target = job.run_dir / "checkpoints" / "step-00000003.pt"
    for rank in range(world_size):  # rank 0 writes; every rank is told, at a control point
        assert (
            f"write checkpoint at step 3 failed: rank 0: CheckpointError: cannot write "
            f"checkpoint {target}: InjectedFault: injected fault at checkpoint_commit on rank 0; "
            "the previous checkpoints are intact"
        ) in job.output(rank)
    assert list_checkpoints(job.run_dir) == [] and not _temporaries(job.run_dir)
    # Reported at the first control point after the write failed, or when the next checkpoint
    # waits for it (a slow write) at step 6: long before the end (step 22).
    assert harness.logged_step(job.run_dir) <= 6


def _open_or_mapped_under(pid: int, directory: Path) -> list[str]:
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    fds = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            fds.append(str(fd.readlink()))
        except FileNotFoundError:  # closed meanwhile
            continue
    return [line for line in maps + fds if str(directory) in line]


@pytest.mark.parametrize("async_checkpoint", [True, False])
def test_a_resumed_job_keeps_nothing_of_its_rotated_checkpoint_and_logs_each_save(
    harness, reference, make_config, tmp_path: Path, async_checkpoint: bool
) -> None:
    resumed_from = harness.EPOCH_STEPS
    train = {"ckpt_interval": 1, "keep_last": 1, "async_checkpoint": async_checkpoint}
    config = make_config(train=train)
    harness.copy_checkpoint(reference, resumed_from, config.with_suffix(""))
    job = harness.Job(config, env={"NEDOLM_TEST_DELAY": "data_fetch=0.4"})
    run_dir = job.run_dir
    old = run_dir / "checkpoints" / f"step-{resumed_from:08d}.pt"
    job.wait_for(lambda: not old.exists(), "rotation to delete the resumed-from checkpoint")
    held = [
        line
        for line in _open_or_mapped_under(job.procs[0].pid, run_dir / "checkpoints")
        if old.name in line or "(deleted)" in line
    ]
    assert held == []
    job.wait_ok()
    assert harness.step_losses(run_dir) == {
        s: v for s, v in harness.step_losses(reference).items() if s > resumed_from
    }
    saves = [r for r in read_metrics(run_dir) if r.get("kind") == "checkpoint"]
    assert [r["step"] for r in saves] == list(range(resumed_from + 1, harness.MAX_STEPS + 1))
    for record in saves:
        assert record["background"] is async_checkpoint
        assert record["pause_s"] > 0 and record["write_s"] > 0
    log = (run_dir / "train.log").read_text(encoding="utf-8")
    assert f"checkpoint at step {harness.MAX_STEPS}: training paused " in log
