"""``bench/trainer_gpu.py`` starts a section only if it is expected to end before the deadline
(``bench/gpu.sh`` kills the script at its hard timeout): a late section is skipped whole and
says why, rather than being killed half-way on a GPU whose minutes are few."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


def test_a_section_fits_only_if_its_expected_time_is_left(trainer_gpu) -> None:
    deadline = trainer_gpu.Deadline(290.0, time.monotonic() + 30.0)
    assert deadline.too_late(20.0) is None
    late = deadline.too_late(40.0)
    assert late is not None and late.startswith("~40 s expected, ") and late.endswith(" of 290 s")
    passed = trainer_gpu.Deadline(290.0, time.monotonic() - 5.0)
    assert passed.left() == 0.0
    assert passed.too_late(0.0) is None  # reading files costs nothing: it still runs
    assert passed.too_late(1.0) == "~1 s expected, 0 s left of 290 s"


def test_the_deadline_counts_from_when_gpu_sh_started_the_script(trainer_gpu) -> None:
    """gpu.sh's hard timeout starts before the script's imports: they count too."""
    started = trainer_gpu.Deadline.counted_from(290.0, time.time() - 100.0)
    assert 189.0 < started.left() <= 190.0
    assert 100.0 <= started.used() < 101.0
    now = trainer_gpu.Deadline.counted_from(290.0, None)
    assert 289.0 < now.left() <= 290.0


def test_a_launch_the_deadline_leaves_no_time_for_is_skipped_not_started(
    trainer_gpu, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = trainer_gpu.plan_for(argparse.Namespace(smoke=True, data=[], steps=3))
    deadline = trainer_gpu.Deadline(60.0, time.monotonic() + 39.0)  # a launch expects 40 s
    missing = tmp_path / "never-read"
    trainer_gpu.launch_section(plan, missing, missing, tmp_path, deadline)
    out = capsys.readouterr().out
    for parallelism in ("ddp", "fsdp"):
        assert f"| {parallelism} | skipped: ~40 s expected, " in out, out
    assert list(tmp_path.iterdir()) == []  # not even its config was written


def test_the_script_skips_a_late_section_whole_and_says_why() -> None:
    """A deadline of 100 s that started counting 100 s ago (gpu.sh's --started-at): the
    launch (40 s expected) is skipped, and the section times say so."""
    script = BENCH / "trainer_gpu.py"
    started = f"{time.time() - 100:.3f}"
    cmd = [sys.executable, str(script), "--smoke", "--launch-only", "--deadline-s", "100",
           "--started-at", started]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "(e. launch skipped: ~40 s expected, 0 s left of 100 s)" in proc.stdout, proc.stdout
    assert "## e." not in proc.stdout, proc.stdout
    times = proc.stdout.split("## Section times (wall seconds, this run)", 1)[1]
    assert re.search(r"^\| prepare the corpus and the base \| - \| [\d.]+ \|$", times, re.M), times
    assert "| e. launch | 40 | skipped |" in times, times
    used = re.search(r"^(\d+) s of the 100 s deadline used", times, re.M)
    assert used and int(used[1]) > 100, times
