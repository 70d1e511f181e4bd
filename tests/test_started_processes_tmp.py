"""What the processes a test starts leave in their temporary directory stays in this run's
pytest basetemp (the root conftest's ``TMPDIR``), not in the machine's /tmp; the inductor
cache they compile into stays the machine's, shared between runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PRINT_TEMP_AND_CACHE = (
    "import os, tempfile; print(tempfile.gettempdir()); "
    "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
)


def test_a_started_process_gets_the_runs_temp_dir_and_the_machines_inductor_cache(
    tmp_path_factory: pytest.TempPathFactory, temp_dir_of_started_processes: Path
) -> None:
    temp, cache = subprocess.run(
        [sys.executable, "-c", PRINT_TEMP_AND_CACHE], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert Path(temp) == temp_dir_of_started_processes
    assert temp_dir_of_started_processes.is_relative_to(tmp_path_factory.getbasetemp())
    assert cache == os.environ["TORCHINDUCTOR_CACHE_DIR"]  # this process's: the machine's
    assert not Path(cache).is_relative_to(temp_dir_of_started_processes)


def test_the_log_tree_torchrun_leaves_behind_is_in_the_runs_temp_dir(
    temp_dir_of_started_processes: Path,
) -> None:
    """torchrun makes a ``torchelastic_*`` tree per launch and never removes it."""
    before = set(temp_dir_of_started_processes.glob("torchelastic_*"))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    subprocess.run(
        [*torchrun, "--nproc-per-node", "1", "--no-python", "true"],
        capture_output=True,
        check=True,
        timeout=120,
    )
    assert len(set(temp_dir_of_started_processes.glob("torchelastic_*")) - before) == 1
