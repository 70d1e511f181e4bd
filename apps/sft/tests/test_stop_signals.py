"""Stop signals to ``nedolm-sft run`` and ``launch`` as real processes: a SIGTERM/SIGUSR1 during
the imports or the compile warm-up ends the job with exit 0 before step 1 (nothing to save, no
checkpoint), a first Ctrl-C stops on a checkpoint, a second one aborts naming the checkpoint
left, and each signal says so in one line when it arrives."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from nedolm.train.checkpoint import list_checkpoints, load_checkpoint
from nedolm.train.metrics import read_metrics
from nedolm.train.stop_record import STOP_RECORD
from nedolm.train.testing import (
    SMALL_BASE,
    STOP_TEST_MAX_STEPS,
    LaunchedJob,
    caught_signals,
    init_tiny_base,
    torch_at_stop_installs,
    write_stop_test_config,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    out = tmp_path_factory.mktemp("base") / "base"
    return init_tiny_base(out, corpus, {**SMALL_BASE, "max_seq_len": 256}, seed=1)


def run(config: Path, *options: str, env: dict[str, str] | None = None) -> LaunchedJob:
    """``python -m nedolm_sft run CONFIG OPTIONS`` in its own session, output in a file."""
    return LaunchedJob(
        [sys.executable, "-m", "nedolm_sft", "run", str(config), *options], config, env
    )


def launch(config: Path, env: dict[str, str] | None = None, *options: str) -> LaunchedJob:
    """``nedolm-sft launch --standalone --nproc-per-node 2 CONFIG OPTIONS`` (compile as
    configured)."""
    cmd = [sys.executable, "-m", "nedolm_sft", "launch", "--standalone", "--nproc-per-node", "2"]
    env = {"NEDOLM_DIST_TIMEOUT_S": "30", **(env or {})}
    return LaunchedJob([*cmd, str(config), *options], config, env)


def wait_for_log(job: LaunchedJob, needle: str, count: int = 1) -> None:
    """Until ``needle`` is in the run's train.log ``count`` times; the job must not exit first."""
    log = job.run_dir / "train.log"
    job.wait_for(
        lambda: log.exists() and log.read_text(encoding="utf-8").count(needle) >= count,
        f"{needle!r} {count} times in train.log",
        timeout=180,
    )


def wait_for_handler(job: LaunchedJob, signum: int) -> None:
    """Until the job's process handles ``signum`` (~50 ms after it starts): signalled earlier,
    the default action kills it, as it would any program."""
    name = signal.Signals(signum).name
    job.wait_for(lambda: signum in caught_signals(job.proc.pid), f"a {name} handler", timeout=30)


def trained_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir) if "loss" in r]


def assert_stopped_before_step_1(run_dir: Path) -> None:
    """No step trained, no checkpoint, and a stop record that says so."""
    assert trained_steps(run_dir) == []
    assert list_checkpoints(run_dir) == []
    record = json.loads((run_dir / STOP_RECORD).read_text(encoding="utf-8"))
    assert (record["step"], record["trained"]) == (0, False)


@pytest.mark.parametrize("command", ["run", "launch"])
def test_the_stop_handlers_are_installed_before_torch_is_imported(
    command: str, tmp_path: Path
) -> None:
    """The seconds torch takes to import are covered (the next tests signal in them)."""
    assert torch_at_stop_installs("nedolm_sft", command, str(tmp_path / "none.yaml")) == [False]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_during_the_imports_exits_0_before_step_1_with_nothing_saved(
    corpus: Path, base: Path, tmp_path: Path, signum: int
) -> None:
    config = write_stop_test_config(tmp_path / "early.yaml", corpus, base)
    job = run(config)
    # Torch takes seconds to import, after the handlers (before the fix this killed the job).
    wait_for_handler(job, signum)
    os.kill(job.proc.pid, signum)
    code, out = job.wait(), job.output()
    name = signal.Signals(signum).name
    assert code == 0, out[-3000:]
    assert f"nedolm: {name} received: stopping before training starts; nothing new to save" in out
    assert f"stop requested ({name}): stopped before step 1; nothing to save" in out
    assert_stopped_before_step_1(config.with_suffix(""))


def test_a_sigterm_during_the_compile_warm_up_stops_without_training_a_step(
    corpus: Path, base: Path, tmp_path: Path
) -> None:
    config = write_stop_test_config(tmp_path / "warmup.yaml", corpus, base, compile=True)
    # The delay sits inside the warm-up, before torch.compile runs: room to signal there.
    job = run(config, env={"NEDOLM_TEST_DELAY": "compile_warmup=3"})
    wait_for_log(job, "compile warm-up started")
    os.kill(job.proc.pid, signal.SIGTERM)
    job.wait_ok()
    run_dir = job.run_dir
    log = (run_dir / "train.log").read_text(encoding="utf-8")
    assert "compile warm-up done" in log  # the warm-up finished; then no step was trained
    assert "stop requested (SIGTERM): stopped before step 1; nothing to save" in log
    assert "training steps" not in log
    assert_stopped_before_step_1(run_dir)


def test_first_ctrl_c_stops_on_a_checkpoint_and_a_second_aborts_naming_the_one_left(
    corpus: Path, base: Path, tmp_path: Path
) -> None:
    config = write_stop_test_config(tmp_path / "ctrl-c.yaml", corpus, base)
    job = run(config, "--no-compile", env={"NEDOLM_TEST_DELAY": "data_fetch=0.3"})
    job.wait_for_step(2)
    os.kill(job.proc.pid, signal.SIGINT)
    job.wait_ok()
    run_dir, out = job.run_dir, job.output()
    [(stopped, path)] = list_checkpoints(run_dir)
    assert 2 <= stopped < STOP_TEST_MAX_STEPS and load_checkpoint(path)["step"] == stopped
    assert (
        "nedolm: SIGINT received: stopping after the next optimizer step; a checkpoint is coming "
        "(Ctrl-C again aborts without it)"
    ) in out
    assert f"stop requested (SIGINT): stopped at step {stopped}" in out

    # The resume: a second Ctrl-C while its stop checkpoint is being written aborts it.
    files = sorted((run_dir / "checkpoints").iterdir())
    slow_save = {"NEDOLM_TEST_DELAY": "data_fetch=0.3,checkpoint_write=60"}
    job = run(config, "--no-compile", env=slow_save)
    job.wait_for_step(stopped + 1)
    os.kill(job.proc.pid, signal.SIGINT)
    wait_for_log(job, "writing checkpoint at step", count=2)  # the first job's and this one's
    os.kill(job.proc.pid, signal.SIGINT)
    code, out = job.wait(), job.output()
    assert code == 128 + signal.SIGINT, out[-3000:]
    assert "nedolm: SIGINT again: aborting now, without a checkpoint" in out
    assert f"aborted by a second SIGINT: the newest valid checkpoint is {path}" in out
    assert sorted((run_dir / "checkpoints").iterdir()) == files  # nothing half-written


def test_a_sigterm_to_the_launcher_before_any_rank_trained_exits_0(
    corpus: Path, base: Path, tmp_path: Path
) -> None:
    job = launch(write_stop_test_config(tmp_path / "early.yaml", corpus, base))
    wait_for_handler(job, signal.SIGTERM)  # still importing torch; no rank yet
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.wait() == 0, job.output()[-3000:]
    assert "launch: SIGTERM: stopped before any rank started; nothing to save" in job.output()
    assert not (job.run_dir / "train.log").exists()

    warmup = write_stop_test_config(tmp_path / "warmup.yaml", corpus, base, compile=True)
    job = launch(warmup, env={"NEDOLM_TEST_DELAY": "compile_warmup=3"})
    wait_for_log(job, "compile warm-up started")
    os.kill(job.proc.pid, signal.SIGTERM)  # the ranks are up, in the warm-up
    assert job.wait() == 0, job.output()[-3000:]
    out = job.output()
    for rank in (0, 1):
        assert f"[rank {rank}] WARNING stop requested (SIGTERM): stopped before step 1" in out
    assert "launch: SIGTERM: every rank stopped before step 1; nothing to save" in out
    assert_stopped_before_step_1(job.run_dir)


def test_ctrl_c_in_the_launchers_terminal_stops_every_rank_and_a_second_aborts(
    corpus: Path, base: Path, tmp_path: Path
) -> None:
    """A terminal's Ctrl-C reaches the launcher's process group (torch starts the ranks in
    sessions of their own, so they hear of it from the launcher)."""
    config = write_stop_test_config(tmp_path / "ctrl-c.yaml", corpus, base)
    job = launch(config, env={"NEDOLM_TEST_DELAY": "data_fetch=0.3"})
    job.wait_for_step(2)
    os.killpg(job.proc.pid, signal.SIGINT)
    job.wait_ok()
    [(stopped, path)] = list_checkpoints(job.run_dir)
    out = job.output()
    assert f"launch: SIGINT: every rank stopped at step {stopped} on a valid checkpoint" in out
    assert "[rank 1] nedolm: SIGINT received: stopping after the next optimizer step" in out

    job = launch(config, env={"NEDOLM_TEST_DELAY": "data_fetch=0.3,checkpoint_write=60"})
    job.wait_for_step(stopped + 1)
    os.killpg(job.proc.pid, signal.SIGINT)
    wait_for_log(job, "writing checkpoint at step", count=2)  # the first job's and this one's
    os.killpg(job.proc.pid, signal.SIGINT)
    assert job.wait() == 128 + signal.SIGINT, job.output()[-3000:]
    out = job.output()
    assert "[rank 1] nedolm: SIGINT again: aborting now, without a checkpoint" in out
    assert f"launch: aborted by a second SIGINT: the newest valid checkpoint is {path}" in out
    assert list_checkpoints(job.run_dir) == [(stopped, path)]


def test_a_sigterm_to_a_smoke_launch_is_judged_by_its_scratch_run_dir(
    corpus: Path, base: Path, tmp_path: Path
) -> None:
    config = write_stop_test_config(tmp_path / "smoke.yaml", corpus, base)
    job = launch(
        config, {"NEDOLM_TEST_DELAY": "data_fetch=0.3"}, "--smoke-steps", str(STOP_TEST_MAX_STEPS)
    )
    scratch = job.run_dir.with_name(job.run_dir.name + ".smoke")  # where --smoke-steps trains
    job.wait_for(lambda: len(trained_steps(scratch)) >= 2, "2 steps", timeout=180)
    os.kill(job.proc.pid, signal.SIGTERM)
    job.wait_ok()
    [(step, _)] = list_checkpoints(scratch)
    assert f"launch: SIGTERM: every rank stopped at step {step} on a valid checkpoint" in (
        job.output()
    )
