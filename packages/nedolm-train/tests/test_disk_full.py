"""A full disk during a save, made real with a small tmpfs mounted on the run's checkpoints/
(the tests run as root; a user without mount rights sees this test fail with that reason).

The save fails with ENOSPC, the previous checkpoints stay intact, the run ends with one line
saying where and how much space it needed; once space is freed the resume is bitwise exact.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from nedolm.data.atomic import is_temporary
from nedolm.train.checkpoint import list_checkpoints, load_checkpoint
from nedolm.train.testing import mounted_tmpfs

pytestmark = pytest.mark.slow


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "run" / "checkpoints", "4m") as mount_point:
        yield mount_point


def _resize(mount_point: Path, size_bytes: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size_bytes}", str(mount_point)], check=True)


def test_disk_full_during_a_save_keeps_the_previous_checkpoints_and_resumes_exactly(
    harness, reference, make_config, small_tmpfs: Path
) -> None:
    size = (reference / "checkpoints" / f"step-{harness.EPOCH_STEPS:08d}.pt").stat().st_size
    _resize(small_tmpfs, int(2.5 * size))  # room for the checkpoints of steps 3 and 6 only
    config = make_config(train={"ckpt_interval": 3, "keep_last": 10})
    job = harness.Job(config)
    assert job.wait() == [1]
    target = small_tmpfs / "step-00000009.pt"
    failure = [line for line in job.output().splitlines() if "cannot write checkpoint" in line]
    assert failure, job.output()[-3000:]
    assert (
        f"write checkpoint at step 9 failed: rank 0: CheckpointError: cannot write checkpoint "
        f"{target}: No space left on device: it needs about "
    ) in failure[-1]
    assert "MiB free there; the previous checkpoints are intact" in failure[-1]
    assert [step for step, _ in list_checkpoints(job.run_dir)] == [3, 6]
    for step, path in list_checkpoints(job.run_dir):
        assert load_checkpoint(path)["step"] == step  # checksums verify
    assert not [p for p in small_tmpfs.iterdir() if is_temporary(p)]

    _resize(small_tmpfs, 12 * size)  # space freed
    harness.Job(config).wait_ok()
    losses, expected = harness.step_losses(job.run_dir), harness.step_losses(reference)
    assert losses == expected
    harness.assert_same_weights(
        harness.final_weights(job.run_dir), harness.final_weights(reference)
    )
