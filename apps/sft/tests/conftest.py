"""Fixtures shared by the app's tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

RunCli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def nedolm_sft() -> RunCli:
    """Run ``nedolm-sft ARGS…`` as a real process (``python -m nedolm_sft``), output captured."""

    def run(
        *args: str,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "nedolm_sft", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            env=env,
        )

    return run
