"""One job per run directory: a second job is refused naming the holder; a killed holder's lock
frees itself. Real processes, real flock."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nedolm.train.checkpoint import list_checkpoints
from nedolm.train.run_lock import RunDirLocked, acquire_run_lock, holds_run_lock, release_run_lock

_HOLDER = """
import sys, time
from nedolm.train.checkpoint import list_checkpoints
from nedolm.train.run_lock import acquire_run_lock
acquire_run_lock(sys.argv[1])
print("locked", flush=True)
time.sleep(600)
"""


def test_a_second_holder_is_refused_and_a_killed_holders_lock_frees_itself(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        expected = f"in use by another job (host {socket.gethostname()} pid {holder.pid}"
        with pytest.raises(
            RunDirLocked, match=re.escape(f"run_dir {tmp_path} is {expected}")
        ) as refused:
            acquire_run_lock(tmp_path)
        assert "\n" not in str(refused.value) and not holds_run_lock(tmp_path)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    acquire_run_lock(tmp_path)  # kill -9 released it: no stale lock to clean up
    try:
        assert holds_run_lock(tmp_path)
        assert f"pid {os.getpid()}" in (tmp_path / "run.lock").read_text(encoding="utf-8")
    finally:
        release_run_lock(tmp_path)
    assert not holds_run_lock(tmp_path)


@pytest.mark.slow
def test_a_second_trainer_is_refused_naming_the_holder_until_the_holder_is_killed(
    harness, make_config
) -> None:
    config = make_config(train={"ckpt_interval": 2, "max_steps": 3})
    first = harness.Job(config, env={"NEDOLM_TEST_DELAY": "checkpoint_write=600"})
    first.wait_for_log("writing checkpoint at step 2")  # holds the lock, parked in a save
    started = time.monotonic()
    second = harness.Job(config)
    assert second.wait(timeout=60) == [1], second.output()[-3000:]
    assert time.monotonic() - started < 60
    holder = f"host {socket.gethostname()} pid {first.procs[0].pid}"
    refusal = f"RunDirLocked: run_dir {first.run_dir} is in use by another job ({holder}, lock "
    assert f"lock run directory failed: rank 0: {refusal}" in second.output()
    assert first.procs[0].poll() is None  # the holder was not disturbed
    first.signal(signal.SIGKILL)
    first.wait()
    harness.Job(config).wait_ok()  # kill -9 freed the lock: the next job runs
    assert [step for step, _ in list_checkpoints(first.run_dir)] == [2, 3]
