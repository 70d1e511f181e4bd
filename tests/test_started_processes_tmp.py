"""What the processes a test starts leave in their temporary directory stays in this run's
pytest basetemp (the root conftest's ``TMPDIR``), not in the machine's /tmp; the inductor
cache they compile into stays the machine's, shared between runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture
def run_temp(temp_dir_of_started_processes: Path | None) -> Path:
    """The conftest's folder, where this machine's temporary path leaves room for one."""
    if temp_dir_of_started_processes is None:
        pytest.skip("the machine's temporary path is too long for sockets below a folder of it")
    return temp_dir_of_started_processes


PRINT_TEMP_AND_CACHE = (
    "import os, tempfile; print(tempfile.gettempdir()); "
    "print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
)


def test_a_started_process_gets_the_runs_temp_dir_and_the_machines_inductor_cache(
    tmp_path_factory: pytest.TempPathFactory, run_temp: Path
) -> None:
    temp, cache = subprocess.run(
        [sys.executable, "-c", PRINT_TEMP_AND_CACHE], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert Path(temp) == run_temp
    assert run_temp.is_relative_to(tmp_path_factory.getbasetemp())
    assert cache == os.environ["TORCHINDUCTOR_CACHE_DIR"]  # this process's: the machine's
    assert not Path(cache).is_relative_to(run_temp)


def test_the_log_tree_torchrun_leaves_behind_is_in_the_runs_temp_dir(run_temp: Path) -> None:
    """torchrun makes a ``torchelastic_*`` tree per launch and never removes it."""
    before = set(run_temp.glob("torchelastic_*"))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    subprocess.run(
        [*torchrun, "--nproc-per-node", "1", "--no-python", "true"],
        capture_output=True,
        check=True,
        timeout=120,
    )
    assert len(set(run_temp.glob("torchelastic_*")) - before) == 1


def test_a_temp_path_too_long_for_sockets_keeps_the_machines_and_says_so(tmp_path: Path) -> None:
    """Below a long basetemp, multiprocessing's sockets would not fit: the machine's ``TMPDIR``
    stays, and the two tests above are skipped with the reason, not failed or passed."""
    long_basetemp = tmp_path / ("x" * 80)
    repo = Path(__file__).resolve().parents[1]
    this_file = Path(__file__).relative_to(repo)
    tests = [f"{this_file}::{test.__name__}" for test in (
        test_a_started_process_gets_the_runs_temp_dir_and_the_machines_inductor_cache,
        test_the_log_tree_torchrun_leaves_behind_is_in_the_runs_temp_dir,
    )]  # fmt: skip
    pytest_cmd = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [*pytest_cmd, "-rs", f"--basetemp={long_basetemp}", *tests],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "2 skipped" in result.stdout
    assert "too long for sockets" in result.stdout
    assert not (long_basetemp / "tmp").exists()
