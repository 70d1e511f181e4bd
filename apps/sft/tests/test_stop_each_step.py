"""A stop request is honoured after the next optimizer step, with one rank and with two gloo
ranks, at no extra collective per step, and it survives a terminal pipe that died with it
(``nedolm-sft run ... 2>&1 | tee log`` and Ctrl-C: the signal ends tee too)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nedolm.train.checkpoint import list_checkpoints, load_checkpoint
from nedolm.train.metrics import read_metrics
from nedolm.train.testing import (
    JOB_ENV,
    SMALL_BASE,
    STOP_TEST_MAX_STEPS,
    LaunchedJob,
    all_frozen,
    init_tiny_base,
    write_stop_test_config,
)

pytestmark = pytest.mark.slow
# Control points and checkpoints far apart: only the per-step agreement can stop these runs early.
SPARSE_CONTROL = {"control_interval": 1000, "ckpt_interval": 1000}
SLOW_STEPS = {"NEDOLM_TEST_DELAY": "data_fetch=0.3"}
COUNTER = Path(__file__).with_name("collective_counting_rank.py")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    out = tmp_path_factory.mktemp("base") / "base"
    return init_tiny_base(out, corpus, {**SMALL_BASE, "max_seq_len": 256}, seed=1)


def logged_step(run_dir: Path) -> int:
    return max([0] + [r["step"] for r in read_metrics(run_dir) if "loss" in r])


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + 180
    while logged_step(run_dir) < step:
        assert proc.poll() is None, f"the job exited {proc.returncode} before step {step}"
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no step {step} in 180 s")
        time.sleep(0.05)


def stop_checkpoint(run_dir: Path) -> int:
    """The step of the run's one checkpoint, checked to load."""
    [(step, path)] = list_checkpoints(run_dir)
    assert load_checkpoint(path)["step"] == step
    return step


# What a shell does for `nedolm-sft run CONFIG 2>&1 | tee FILE`: both in the shell's process
# group, which a terminal's Ctrl-C reaches whole. The shell outlives the SIGINT (a handler, not
# SIG_IGN, which the children would inherit) and records the job's exit status.
PIPELINE = """
import signal, subprocess, sys
signal.signal(signal.SIGINT, lambda *_: None)
tee_file, status_file, *job = sys.argv[1:]
tee = subprocess.Popen(["tee", tee_file], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
proc = subprocess.Popen(job, stdout=tee.stdin, stderr=subprocess.STDOUT)
tee.stdin.close()
code = proc.wait()
open(status_file, "w").write(f"{code} {tee.wait()}")
"""


def test_ctrl_c_under_tee_stops_on_a_checkpoint_although_the_pipe_died(
    corpus: Path, base: Path, tmp_path: Path
) -> None:
    config = write_stop_test_config(tmp_path / "tee.yaml", corpus, base, **SPARSE_CONTROL)
    run_dir, tee_file, status_file = config.with_suffix(""), tmp_path / "tee.log", tmp_path / "rc"
    job = [sys.executable, "-m", "nedolm_sft", "run", str(config)]
    shell = subprocess.Popen(
        [sys.executable, "-c", PIPELINE, str(tee_file), str(status_file), *job],
        env={**os.environ, **JOB_ENV, **SLOW_STEPS},
        start_new_session=True,
    )
    try:
        wait_for_step(shell, run_dir, 2)
        # Ctrl-C reaches the whole foreground group. tee dies at once; Python runs the job's
        # handler only between bytecodes, so when the signal lands inside a kernel the handler
        # writes into a pipe nobody reads. That order, made certain: tee first, then the group.
        tee_pid = int(Path(f"/proc/{shell.pid}/task/{shell.pid}/children").read_text().split()[0])
        os.kill(tee_pid, signal.SIGINT)
        while Path(f"/proc/{tee_pid}/cmdline").read_bytes():  # empty once it is a zombie
            time.sleep(0.01)
        os.killpg(shell.pid, signal.SIGINT)
        assert shell.wait(timeout=240) == 0
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
    job_code, tee_code = map(int, status_file.read_text().split())
    log = (run_dir / "train.log").read_text(encoding="utf-8")
    assert tee_code == -signal.SIGINT  # the pipe's reader died with the Ctrl-C
    assert job_code == 0, log[-3000:]
    stopped = stop_checkpoint(run_dir)
    assert stopped < STOP_TEST_MAX_STEPS
    assert f"stop requested (SIGINT): stopped at step {stopped}" in log
    assert f"step {stopped}/" in log  # logged to train.log although stderr was gone


def test_one_rank_stops_after_the_next_optimizer_step(
    corpus: Path, base: Path, tmp_path: Path
) -> None:
    config = write_stop_test_config(tmp_path / "one.yaml", corpus, base, **SPARSE_CONTROL)
    job = LaunchedJob([sys.executable, "-m", "nedolm_sft", "run", str(config)], config, SLOW_STEPS)
    job.wait_for_step(3)
    with all_frozen(job.proc.pid):  # the job has not logged step s+1 when the signal lands
        signalled_after = logged_step(job.run_dir)
        os.kill(job.proc.pid, signal.SIGTERM)
    job.wait_ok()
    # Step s+1's fetch (0.3 s of the 0.3 s step) carries the request; at worst it arrived just
    # after that all-reduce, and step s+2's carries it.
    assert signalled_after < stop_checkpoint(job.run_dir) <= signalled_after + 2
    assert "SIGTERM received: stopping after the next optimizer step" in job.output()


def test_a_signal_to_one_of_two_ranks_stops_both_after_the_next_step(
    corpus: Path, base: Path, tmp_path: Path
) -> None:
    config = write_stop_test_config(tmp_path / "two.yaml", corpus, base, **SPARSE_CONTROL)
    cmd = [sys.executable, "-m", "nedolm_sft", "launch", "--standalone", "--nproc-per-node", "2"]
    job = LaunchedJob([*cmd, str(config)], config, {"NEDOLM_DIST_TIMEOUT_S": "30", **SLOW_STEPS})
    job.wait_for_step(3)
    ranks = job.rank_pid(0), job.rank_pid(1)
    with all_frozen(*ranks):  # rank 0 (which logs) has not logged step s+1 when it lands
        signalled_after = logged_step(job.run_dir)
        os.kill(ranks[1], signal.SIGTERM)  # rank 0 hears of it only through the all-reduce
    job.wait_ok()
    assert signalled_after < stop_checkpoint(job.run_dir) <= signalled_after + 2
    assert "[rank 1] nedolm: SIGTERM received: stopping after the next optimizer step" in (
        job.output()
    )


def count_collectives(config: Path, out_dir: Path) -> list[int]:
    """Each rank's collectives over a whole 2-rank torchrun job of ``config``."""
    out_dir.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*cmd, str(COUNTER), str(config), str(out_dir)],
        env={**os.environ, **JOB_ENV},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out_dir / f"rank-{r}.json").read_text())["count"] for r in (0, 1)]


def test_each_optimizer_step_makes_exactly_one_collective(
    corpus: Path, base: Path, tmp_path: Path
) -> None:
    """Two runs that differ only in length: the extra steps cost one collective each (the fetch's
    all-reduce, which carries the stop flag), on both ranks."""
    quiet = {"control_interval": 1000, "ckpt_interval": 1000, "log_interval": 1000}
    short = write_stop_test_config(tmp_path / "short.yaml", corpus, base, **quiet, max_steps=3)
    long = write_stop_test_config(tmp_path / "long.yaml", corpus, base, **quiet, max_steps=9)
    short_counts = count_collectives(short, tmp_path / "short-counts")
    long_counts = count_collectives(long, tmp_path / "long-counts")
    assert [b - a for a, b in zip(short_counts, long_counts, strict=True)] == [6, 6]
