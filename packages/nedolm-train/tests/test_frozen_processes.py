"""``all_frozen``, which the stop tests rely on to read a job's progress and signal it at one
point: a real process counting in a file neither counts nor handles a signal sent inside the
block, and does both once it ends."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nedolm.train.testing import JobFailed, all_frozen, frozen, pending_signals, process_running

# Counts in COUNT every 10 ms (one fixed-width write each: a freeze never finds it half-written);
# on SIGTERM writes the count it had reached to HANDLED and exits.
COUNTER = """
import os, signal, sys, time
count_file, handled_file = sys.argv[1:]
fd = os.open(count_file, os.O_WRONLY | os.O_CREAT)
count = 0
def handle(*_):
    open(handled_file, "w").write(str(count))
    sys.exit(0)
signal.signal(signal.SIGTERM, handle)
while True:
    count += 1
    os.pwrite(fd, b"%012d" % count, 0)
    time.sleep(0.01)
"""


def _count(path: Path) -> int:
    text = path.read_text() if path.exists() else ""
    return int(text) if text else 0  # not created yet


def test_a_frozen_process_neither_counts_nor_handles_a_signal_until_the_block_ends(
    tmp_path: Path,
) -> None:
    count_file, handled_file = tmp_path / "count", tmp_path / "handled"
    child = subprocess.Popen([sys.executable, "-c", COUNTER, str(count_file), str(handled_file)])
    try:
        while _count(count_file) < 3:  # running
            assert child.poll() is None
            time.sleep(0.01)
        with all_frozen(child.pid):
            assert frozen(child.pid)
            seen = _count(count_file)
            time.sleep(0.3)  # ~30 counts if it ran
            child.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            assert _count(count_file) == seen
            assert signal.SIGTERM in pending_signals(child.pid)
            assert not handled_file.exists()
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
    # Handled as soon as it went on: at the count frozen in the file, or one more if the freeze
    # came between counting and writing.
    assert int(handled_file.read_text()) - seen in (0, 1)


def test_a_process_that_has_ended_is_named_at_once_not_waited_for() -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    while process_running(ended.pid):  # a zombie until reaped: it never stops
        time.sleep(0.01)
    started = time.monotonic()
    failed = pytest.raises(JobFailed, match=rf"processes \[{ended.pid}\] ended before")
    with failed, all_frozen(ended.pid):
        pytest.fail("the block ran")
    assert time.monotonic() - started < 10  # not all_frozen's 30 s timeout
    ended.wait()
