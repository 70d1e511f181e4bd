"""One job per run directory: a second job is refused naming the holder; a killed holder's lock
frees itself, also while a child it forked lives on. Real processes, real record locks."""

from __future__ import annotations

import contextlib
import logging
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
        _assert_refused_naming(tmp_path, os.getpid())  # seen from another process
        with pytest.raises(RunDirLocked, match="already locked by this process"):
            acquire_run_lock(tmp_path)  # a second descriptor would drop the lock on close
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


def _assert_refused_naming(run_dir: Path, pid: int) -> None:
    """Another process tries to take ``run_dir`` and is refused, naming ``pid`` as holder."""
    probe = "import sys\nfrom nedolm.train.run_lock import acquire_run_lock\n"
    probe += "acquire_run_lock(sys.argv[1])"
    tried = subprocess.run(
        [sys.executable, "-c", probe, str(run_dir)], capture_output=True, text=True, timeout=120
    )
    assert tried.returncode == 1, tried.stderr
    assert f"RunDirLocked: run_dir {run_dir} is in use by another job (host " in tried.stderr
    assert f" pid {pid}, lock " in tried.stderr


_FORKING_HOLDER = """
import os, sys, time
from nedolm.train.run_lock import acquire_run_lock
acquire_run_lock(sys.argv[1])
child = os.fork()
if child == 0:  # like a DataLoader worker: forked while the lock is held, outlives its parent
    time.sleep(600)
    os._exit(0)
print(child, flush=True)
time.sleep(600)
"""


def test_a_forked_child_of_a_killed_holder_does_not_keep_the_lock(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What a requeue meets after ``kill -9`` of a trainer whose loader workers still run."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _FORKING_HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    child = int(holder.stdout.readline())
    try:
        _assert_refused_naming(tmp_path, holder.pid)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        os.kill(child, 0)  # the child still runs, with the lock file's descriptor open
        with caplog.at_level(logging.WARNING, logger="nedolm.train.run_lock"):
            acquire_run_lock(tmp_path)
        release_run_lock(tmp_path)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(holder.pid, signal.SIGKILL)
    [warning] = [record.getMessage() for record in caplog.records]
    assert warning == (
        f"run_dir {tmp_path}: its lock names host {socket.gethostname()} pid {holder.pid}, "
        "which ended without releasing it (killed?); taking it over"
    )


def test_a_dead_recorded_holder_is_taken_over_with_one_log_line_and_a_release_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = f"host {socket.gethostname()} pid {int(ended.stdout)}"
    lock_file = tmp_path / "run.lock"
    lock_file.write_text(f"{dead}\n", encoding="utf-8")  # what a killed job leaves
    with caplog.at_level(logging.WARNING, logger="nedolm.train.run_lock"):
        acquire_run_lock(tmp_path)
        release_run_lock(tmp_path)
        [warning] = [record.getMessage() for record in caplog.records]
        assert f"its lock names {dead}, which ended without releasing it" in warning
        # A clean finish leaves a file that no reader takes for a live holder.
        me = f"host {socket.gethostname()} pid {os.getpid()}"
        assert lock_file.read_text(encoding="utf-8") == f"released by {me}\n"
        caplog.clear()
        acquire_run_lock(tmp_path)
        release_run_lock(tmp_path)
        assert caplog.records == []


_KILLED_WRITER = """
import sys, time
from pathlib import Path
from nedolm.data.atomic import atomic_write
from nedolm.train.run_lock import acquire_run_lock
run_dir = Path(sys.argv[1])
acquire_run_lock(run_dir)

def write(handle):
    handle.write(b"half a compile cache")
    handle.flush()
    print("writing", flush=True)
    time.sleep(600)

atomic_write(run_dir / "compile_cache.bin", write)
"""


def test_temporaries_of_a_killed_write_are_removed_when_the_lock_is_taken(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kept = [tmp_path / ".hidden", tmp_path / "checkpoints" / ".step-00000002.pt.tmp-1"]
    kept[1].parent.mkdir()
    for path in kept:
        path.write_bytes(b"not this module's")  # checkpoints/ is the saves' to clean
    writer = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout.readline().strip() == "writing"
        [temporary] = [p for p in tmp_path.iterdir() if p.name.startswith(".compile_cache.bin")]
        _assert_refused_naming(tmp_path, writer.pid)
        assert temporary.exists()  # a live job's write is left alone
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=30)
    with caplog.at_level(logging.INFO, logger="nedolm.train.run_lock"):
        acquire_run_lock(tmp_path)
    release_run_lock(tmp_path)
    assert not temporary.exists() and not (tmp_path / "compile_cache.bin").exists()
    assert all(path.exists() for path in kept)
    assert (
        f"run_dir {tmp_path}: removed 1 temporary file(s) left by a killed write: {temporary.name}"
        in [record.getMessage() for record in caplog.records]
    )
