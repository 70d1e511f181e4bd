"""``watch_launcher`` with real processes: a rank whose launcher is SIGKILLed, or already gone,
receives SIGTERM; without a launcher in the environment nothing is watched."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from nedolm.dist import LAUNCHER_PID_ENV, watch_launcher

RANK = """
import signal, sys, time
from nedolm.dist import watch_launcher

def stop(signum, frame):
    print("SIGTERM", flush=True)
    sys.exit(0)

signal.signal(signal.SIGTERM, stop)
watch_launcher()
print("watching", flush=True)
time.sleep(20)
sys.exit(3)
"""


def start_rank(launcher_pid: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", RANK],
        env={**os.environ, LAUNCHER_PID_ENV: str(launcher_pid)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_rank_gets_sigterm_when_its_launcher_is_killed() -> None:
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    rank = start_rank(launcher.pid)
    assert rank.stdout is not None and rank.stdout.readline() == "watching\n"
    launcher.kill()
    killed = time.monotonic()
    launcher.wait()
    out, err = rank.communicate(timeout=10)
    assert rank.returncode == 0 and out == "SIGTERM\n", (rank.returncode, out, err)
    assert time.monotonic() - killed < 5
    assert f"nedolm: the launcher (pid {launcher.pid}) is gone: stopping as on SIGTERM" in err


def test_a_launcher_gone_before_the_rank_starts_stops_it_at_once() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    rank = start_rank(gone.pid)
    out, err = rank.communicate(timeout=30)
    assert rank.returncode == 0 and out.endswith("SIGTERM\n"), (rank.returncode, out, err)


def test_without_a_launcher_nothing_is_watched() -> None:
    assert watch_launcher({}) is None


@pytest.mark.parametrize("raw", ["abc", "0", "-3"])
def test_a_malformed_launcher_pid_is_named(raw: str) -> None:
    with pytest.raises(ValueError, match=f"{LAUNCHER_PID_ENV}='{raw}' is not a process id"):
        watch_launcher({LAUNCHER_PID_ENV: raw})
