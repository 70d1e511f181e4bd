"""``nedolm-sft --debug`` shows where a failed run's error came from: the stack of the cause
under the rank's error, whose frames the trainer releases before it reports (on Python 3.10,
which prints no exception notes, as on 3.11+)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nedolm.train.testing import SMALL_BASE, init_tiny_base, write_sft_config


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    out = tmp_path_factory.mktemp("base") / "base"
    return init_tiny_base(out, corpus, SMALL_BASE)


def failing_run(tmp_path: Path, corpus: Path, base: Path, *options: str) -> str:
    """Run one step whose checkpoint fails on rank 0 (exit 1); return stderr."""
    tmp_path.mkdir()
    train = {"max_steps": 1, "num_workers": 0, "compile": False}
    config = write_sft_config(
        tmp_path / "run.yaml", corpus, base, train=train, validation={"enabled": False}
    )
    env = {**os.environ, "NEDOLM_TEST_FAULT": "checkpoint_write@0", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "nedolm_sft", *options, "run", str(config)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    return result.stderr


def test_debug_shows_the_stack_of_the_cause(tmp_path: Path, corpus: Path, base: Path) -> None:
    fault = "injected fault at checkpoint_write on rank 0"
    quiet = failing_run(tmp_path / "quiet", corpus, base)
    assert f"error: prepare checkpoint at step 1 failed: {fault}" in quiet
    assert "Traceback" not in quiet
    loud = failing_run(tmp_path / "loud", corpus, base, "--debug")
    assert f"InjectedFault: {fault}" in loud
    for frame in ("in rank_state", "in maybe_inject"):  # where the cause was raised
        assert frame in loud, loud[-3000:]
