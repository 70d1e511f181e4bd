"""``nedolm-sft launch`` with real processes and real signals (2 gloo ranks): a SIGTERM to the
launcher stops every rank on one checkpoint and exits 0, the resume reproduces the uninterrupted
run exactly, a stop that a rank did not survive exits 128 + SIGTERM naming why, and a launcher
killed outright takes its ranks with it on a checkpoint (its empty log folder goes at the next
launch)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed import run as torchrun

from nedolm.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from nedolm.train.metrics import read_metrics
from nedolm.train.stop_record import STOP_RECORD
from nedolm.train.testing import (
    SMALL_BASE,
    STOP_TEST_MAX_STEPS,
    LaunchedJob,
    frozen,
    init_tiny_base,
    pending_signals,
    process_running,
    write_stop_test_config,
)

pytestmark = pytest.mark.slow
SLOW_FETCH = {"NEDOLM_TEST_DELAY": "data_fetch=0.3"}  # room to act mid-run; no numeric effect


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    out = tmp_path_factory.mktemp("base") / "base"
    return init_tiny_base(out, corpus, {**SMALL_BASE, "max_seq_len": 256}, seed=1)


def launch(
    config: Path,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    options: tuple[str, ...] = (),
) -> LaunchedJob:
    """``nedolm-sft launch --standalone --nproc-per-node N [OPTIONS] CONFIG --no-compile``."""
    cmd = [sys.executable, "-m", "nedolm_sft", "launch", "--standalone"]
    cmd += ["--nproc-per-node", str(nproc), *options, str(config), "--no-compile"]
    return LaunchedJob(cmd, config, {"NEDOLM_DIST_TIMEOUT_S": "30", **(env or {})})


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(latest_checkpoint(run_dir))["model"]


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """Bitwise the uninterrupted run: every step's loss and the final weights."""
    assert losses(run_dir) == losses(reference)
    ours, theirs = final_weights(run_dir), final_weights(reference)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), f"{key} differs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path, base: Path) -> Path:
    """The run dir of the uninterrupted 2-rank run of ``write_stop_test_config``."""
    root = tmp_path_factory.mktemp("reference")
    job = launch(write_stop_test_config(root / "reference.yaml", corpus, base))
    job.wait_ok()
    return job.run_dir


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A temporary directory of the test's own for the launches (their ``TMPDIR``)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    return folder


def test_sigterm_to_the_launcher_stops_every_rank_on_one_checkpoint_exits_0_and_resumes_exactly(
    corpus: Path, base: Path, tmp_path: Path, reference: Path, scratch: Path
) -> None:
    config = write_stop_test_config(tmp_path / "stopped.yaml", corpus, base)
    in_scratch = {"TMPDIR": str(scratch)}
    job = launch(config, env={**SLOW_FETCH, **in_scratch})
    job.wait_for_step(3)
    os.kill(job.proc.pid, signal.SIGTERM)  # the launcher itself, as a scheduler would
    signalled = time.monotonic()
    job.wait_ok()
    out = job.output()
    assert time.monotonic() - signalled < 25, "the ranks did not exit on their own"
    [(step, path)] = list_checkpoints(job.run_dir)
    for rank in (0, 1):  # every rank agreed on the same stop step, then returned normally
        assert f"[rank {rank}] WARNING stop requested (SIGTERM): stopped at step {step}" in out
    assert f"launch: SIGTERM: every rank stopped at step {step} on a valid checkpoint" in out
    state = load_checkpoint(path)
    assert 3 <= step < STOP_TEST_MAX_STEPS and len(state["ranks"]) == 2
    assert state["progress"]["step"] == step

    launch(config, env=in_scratch).wait_ok()  # same world size: bitwise the same
    assert_same_run(job.run_dir, reference)

    single = launch(config, nproc=1, env=in_scratch)  # refused, naming both sizes
    assert single.wait() == 1
    assert "execution.world_size: checkpoint 2 != now 1" in single.output()
    assert "rank 0 failed first (exit code 1; its log is above)" in single.output()
    assert list(scratch.rglob("attempt_*")) == []  # a stop, an end and a failure left nothing


def test_a_rank_killed_during_the_stop_makes_the_launcher_exit_128_plus_sigterm(
    corpus: Path, base: Path, tmp_path: Path
) -> None:
    config = write_stop_test_config(tmp_path / "unclean.yaml", corpus, base)
    job = launch(config, env=SLOW_FETCH)
    job.wait_for_step(2)
    rank1 = job.rank_pid(1)
    # Frozen first, so that it cannot take part in the stop (killed after the SIGTERM, it could
    # still agree on the stop and hand over its state, and the checkpoint be written), and
    # killed once the launcher has passed the SIGTERM on: pending on the frozen rank 1 then.
    # Every thread must have stopped before the SIGTERM is sent: a thread that has not yet
    # taken the SIGSTOP takes the SIGTERM first (the lower number) and it is no longer pending.
    os.kill(rank1, signal.SIGSTOP)
    job.wait_for(lambda: frozen(rank1), "rank 1 stopped")
    os.kill(job.proc.pid, signal.SIGTERM)
    job.wait_for(lambda: signal.SIGTERM in pending_signals(rank1), "the SIGTERM for rank 1")
    os.kill(rank1, signal.SIGKILL)  # rank 1 never reaches the agreed stop step
    assert job.wait() == 128 + signal.SIGTERM, job.output()[-4000:]
    out = job.output()
    assert "launch: SIGTERM: the job did not stop cleanly: no rank recorded a clean stop" in out
    assert f"launch: no checkpoint is left in {job.run_dir}; a re-run starts from the base" in out
    assert not (job.run_dir / STOP_RECORD).exists()
    assert list_checkpoints(job.run_dir) == []


def shutdown_grace() -> tuple[tuple[str, ...], int]:
    """(launch options, seconds torch's agent gives signalled ranks before it SIGKILLs them):
    2 s by `--shutdown-timeout` where torchrun has it, else its fixed 30 s (torch 2.10)."""
    if "--shutdown-timeout" in torchrun.get_args_parser()._option_string_actions:
        return ("--shutdown-timeout", "2"), 2
    return (), 30


def test_ranks_sigkilled_after_the_shutdown_timeout_make_the_launcher_exit_128_plus_sigterm(
    corpus: Path, base: Path, tmp_path: Path
) -> None:
    config = write_stop_test_config(tmp_path / "slow.yaml", corpus, base)
    options, grace_s = shutdown_grace()
    slow_save = {"NEDOLM_TEST_DELAY": f"data_fetch=0.3,checkpoint_write={grace_s + 8}"}
    job = launch(config, env=slow_save, options=options)
    job.wait_for_step(2)
    os.kill(job.proc.pid, signal.SIGTERM)  # the stop's checkpoint outlasts the grace
    assert job.wait() == 128 + signal.SIGTERM, job.output()[-4000:]
    out = job.output()
    assert "Unable to shutdown process" in out  # torch SIGKILLs after --shutdown-timeout
    assert "launch: SIGTERM: the job did not stop cleanly: no rank recorded a clean stop" in out
    assert f"launch: no checkpoint is left in {job.run_dir}; a re-run starts from the base" in out
    assert list_checkpoints(job.run_dir) == []


def test_sigusr1_slurms_warning_also_stops_cleanly_with_exit_0(
    corpus: Path, base: Path, tmp_path: Path
) -> None:
    job = launch(write_stop_test_config(tmp_path / "usr1.yaml", corpus, base), env=SLOW_FETCH)
    job.wait_for_step(2)
    os.kill(job.proc.pid, signal.SIGUSR1)  # handled by the launcher by default, unlike torchrun
    job.wait_ok()
    [(step, _)] = list_checkpoints(job.run_dir)
    assert f"launch: SIGUSR1: every rank stopped at step {step} on a valid checkpoint" in (
        job.output()
    )
    assert f"[rank 1] WARNING stop requested (SIGUSR1): stopped at step {step}" in job.output()


def test_a_killed_launcher_takes_its_ranks_with_it_and_a_relaunch_resumes_exactly(
    corpus: Path, base: Path, tmp_path: Path, reference: Path, scratch: Path
) -> None:
    """The relaunch also removes the log folder the killed launcher left, and only that."""
    config = write_stop_test_config(tmp_path / "orphaned.yaml", corpus, base)
    in_scratch = {"TMPDIR": str(scratch)}
    job = launch(config, env={**SLOW_FETCH, **in_scratch})
    job.wait_for_step(3)
    ranks = [job.rank_pid(rank) for rank in (0, 1)]
    os.kill(job.proc.pid, signal.SIGKILL)  # the launcher alone: its ranks have own sessions
    killed = time.monotonic()
    assert job.wait() == -signal.SIGKILL
    while any(process_running(pid) for pid in ranks):
        assert time.monotonic() - killed < 30, "a rank outlived its launcher by 30 s"
        time.sleep(0.1)
    out = job.output()
    [(step, _)] = list_checkpoints(job.run_dir)
    assert 3 <= step < STOP_TEST_MAX_STEPS, "the ranks trained on to the end instead of stopping"
    for rank in (0, 1):  # each rank saw the launcher go, then took the SIGTERM stop path
        assert f"[rank {rank}] nedolm: the launcher (pid {job.proc.pid}) is gone" in out
        assert f"[rank {rank}] WARNING stop requested (SIGTERM): stopped at step {step}" in out

    [abandoned] = scratch.glob("nedolm-launch-*")  # the killed launcher's log folder, empty
    host = socket.gethostname()
    assert abandoned.name.startswith(f"nedolm-launch-{host}-{job.proc.pid}-")
    kept = [
        scratch / f"nedolm-launch-{host}-{os.getpid()}-live",  # its launcher still runs
        scratch / f"nedolm-launch-other-{host}-{job.proc.pid}-elsewhere",  # another host's
        scratch / f"nedolm-launch-{host}-{job.proc.pid}-logged" / "0",  # holds a log
    ]
    for folder in kept:
        folder.mkdir(parents=True)
    (kept[-1] / "stderr.log").write_text("a killed launch's log\n", encoding="utf-8")

    launch(config, env=in_scratch).wait_ok()  # at once: the run dir's lock was released
    assert_same_run(job.run_dir, reference)
    left = sorted(scratch.glob("nedolm-launch-*"))
    assert left == sorted([*kept[:2], kept[-1].parent])  # and the relaunch removed its own


def test_a_launch_with_tee_keeps_the_per_rank_logs_and_says_where(
    corpus: Path, base: Path, tmp_path: Path, scratch: Path
) -> None:
    """``--tee`` without ``--log-dir``: the per-rank logs land in the launch's own folder under
    the temporary directory, which then stays (the SIGTERM test above sees it go otherwise)."""
    config = write_stop_test_config(tmp_path / "teed.yaml", corpus, base)
    job = launch(config, env={"TMPDIR": str(scratch)}, options=("--tee", "3"))
    job.wait_ok()
    [tree] = scratch.rglob("attempt_*")
    assert f"launch: torchrun's per-rank logs are in {tree.parent.parent}" in job.output()
    assert sorted(path.name for path in (tree / "1").iterdir()) == ["stderr.log", "stdout.log"]
    rank_0 = (tree / "0" / "stderr.log").read_text(encoding="utf-8")  # rank 0 logs for the job
    assert f"finished at step {STOP_TEST_MAX_STEPS}" in rank_0, rank_0[-2000:]
