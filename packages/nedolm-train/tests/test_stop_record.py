"""The stop record a launcher reads: accepted only for its own launch and when the newest valid
checkpoint is the recorded step (real files; the 2-rank runs are in test_torchrun_faults.py and
the app's test_launch.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nedolm.dist import get_info
from nedolm.train.checkpoint import checkpoint_path, save_checkpoint
from nedolm.train.stop_record import (
    LAUNCH_ID_ENV,
    CleanStop,
    UncleanStop,
    record_stop,
    verify_stop,
)


def save(run_dir: Path, step: int) -> Path:
    payload = {"step": step, "model": {"w": torch.full((64,), float(step))}}
    return save_checkpoint(run_dir, step, payload, keep_last=5, keep_every=0)


@pytest.fixture
def stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run dir whose job (launch id "this") stopped at step 5, after a checkpoint at 4."""
    monkeypatch.setenv(LAUNCH_ID_ENV, "this")
    save(tmp_path, 4)
    save(tmp_path, 5)
    record_stop(get_info(), tmp_path, 5)
    return tmp_path


def test_a_clean_stop_of_this_launch_is_accepted(stopped: Path) -> None:
    assert verify_stop(stopped, "this") == CleanStop(step=5, trained=True)


def test_a_stop_before_the_first_step_of_a_fresh_run_is_accepted_with_no_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LAUNCH_ID_ENV, "this")
    record_stop(get_info(), tmp_path, 0, trained=False)
    assert verify_stop(tmp_path, "this") == CleanStop(step=0, trained=False)
    save(tmp_path, 3)  # a checkpoint the record does not account for
    with pytest.raises(UncleanStop, match=r"stopped at step 0 but .* is .*step-00000003\.pt"):
        verify_stop(tmp_path, "this")


def test_a_stop_before_the_first_step_of_a_resume_names_its_checkpoint(stopped: Path) -> None:
    record_stop(get_info(), stopped, 5, trained=False)
    assert verify_stop(stopped, "this") == CleanStop(step=5, trained=False)


def test_a_record_of_an_earlier_launch_is_refused(stopped: Path) -> None:
    with pytest.raises(UncleanStop, match=r"stop.json is from an earlier job"):
        verify_stop(stopped, "next")


def test_no_record_is_refused(tmp_path: Path) -> None:
    save(tmp_path, 4)
    with pytest.raises(UncleanStop, match=r"no rank recorded a clean stop in .*stop.json"):
        verify_stop(tmp_path, "this")


def test_a_corrupt_stop_checkpoint_is_refused_naming_the_one_that_is_valid(stopped: Path) -> None:
    path = checkpoint_path(stopped, 5)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(UncleanStop, match=r"stopped at step 5 but .* is .*step-00000004\.pt"):
        verify_stop(stopped, "this")


@pytest.mark.parametrize("text", ["{", '{"step": 5}', '["this"]'])
def test_a_damaged_record_is_refused_naming_it(stopped: Path, text: str) -> None:
    (stopped / "stop.json").write_text(text, encoding="utf-8")
    with pytest.raises(UncleanStop, match=r"stop.json: not a stop record"):
        verify_stop(stopped, "this")
