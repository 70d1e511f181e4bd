"""Atomic checkpoint files, their digests, rotation, and what a kill -9 mid-write leaves behind."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from nedolm.train.checkpoint import (
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
    save_model_archive,
    write_run_metadata,
)
from nedolm.train.checksum import checksum_path
from nedolm.train.run_lock import acquire_run_lock, release_run_lock
from nedolm.train.sharded import MANIFEST, PAYLOAD


def _payload(step: int) -> dict[str, object]:
    return {"model": {"w": torch.full((4,), float(step))}, "step": step}


def test_roundtrip_and_latest(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    for step in (1, 2, 10):
        save_checkpoint(tmp_path, step, _payload(step), keep_last=5, keep_every=0)
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 10)
    state = load_checkpoint(latest_checkpoint(tmp_path))
    assert state["step"] == 10 and torch.equal(state["model"]["w"], torch.full((4,), 10.0))


def test_rotation_keeps_last_and_every(tmp_path: Path) -> None:
    for step in range(1, 13):
        save_checkpoint(tmp_path, step, _payload(step), keep_last=2, keep_every=5)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5, 10, 11, 12]


def test_rotation_never_deletes_the_newest_in_a_reused_run_dir(tmp_path: Path) -> None:
    for step in (50, 60):
        save_checkpoint(tmp_path, step, _payload(step), keep_last=1, keep_every=0)
    # A lower step written into the same dir keeps both the highest and the one just written.
    save_checkpoint(tmp_path, 3, _payload(3), keep_last=1, keep_every=0)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 60]


def test_temp_files_are_ignored_and_cleaned_by_the_lock_holder_only(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, _payload(1), keep_last=3, keep_every=0)
    stale = checkpoint_path(tmp_path, 2).with_name(".step-00000002.pt.tmp-999")
    stale.write_bytes(b"half a checkpoint")
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)
    save_checkpoint(tmp_path, 3, _payload(3), keep_last=3, keep_every=0)
    assert stale.exists()  # without the run lock it may be another live job's file
    acquire_run_lock(tmp_path)
    try:
        save_checkpoint(tmp_path, 4, _payload(4), keep_last=3, keep_every=0)
    finally:
        release_run_lock(tmp_path)
    assert not stale.exists()


def test_stray_temporaries_of_either_layout_never_stop_a_save(tmp_path: Path) -> None:
    """A sharded save killed before its rename leaves a directory (``.step-N.tmp-dcp``)."""
    save_checkpoint(tmp_path, 1, _payload(1), keep_last=3, keep_every=0)
    checkpoints = checkpoint_path(tmp_path, 1).parent
    stray_dir = checkpoints / ".step-00000002.tmp-dcp"
    (stray_dir / "__0_0.distcp").parent.mkdir()
    (stray_dir / "__0_0.distcp").write_bytes(b"half a shard")
    stray_file = checkpoints / ".step-00000002.pt.tmp-999"
    stray_file.write_bytes(b"half a checkpoint")
    save_checkpoint(tmp_path, 3, _payload(3), keep_last=3, keep_every=0)
    assert stray_dir.is_dir() and stray_file.exists()  # no run lock: maybe another job's
    acquire_run_lock(tmp_path)
    try:
        save_checkpoint(tmp_path, 4, _payload(4), keep_last=3, keep_every=0)
    finally:
        release_run_lock(tmp_path)
    assert not stray_dir.exists() and not stray_file.exists()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 3, 4]


def _flip_model_byte(path: Path, step: int) -> None:
    """Flip a byte inside the stored weights: torch.load reads the file without complaint."""
    data = bytearray(path.read_bytes())
    offset = bytes(data).find(_payload(step)["model"]["w"].numpy().tobytes())
    assert offset > 0
    data[offset + 1] ^= 0x40
    path.write_bytes(bytes(data))


def test_the_digest_travels_inside_the_file(tmp_path: Path, caplog) -> None:
    """``cp checkpoints/*.pt`` leaves the sidecars behind: the copy still verifies."""
    for step in (1, 2):
        path = save_checkpoint(tmp_path, step, _payload(step), keep_last=3, keep_every=0)
    sidecar = checksum_path(path).read_text(encoding="ascii").strip()
    assert sidecar == hashlib.sha256(path.read_bytes()).hexdigest()  # sha256sum -c works
    assert zipfile.ZipFile(path).comment.startswith(b"nedolm-sha256:")
    for step in (1, 2):
        checksum_path(checkpoint_path(tmp_path, step)).unlink()
    assert latest_checkpoint(tmp_path, require_digest=True) == path
    _flip_model_byte(path, 2)
    with pytest.raises(CheckpointError, match=r"is corrupt: sha256 .* the digest inside it"):
        load_checkpoint(path)
    with caplog.at_level(logging.WARNING, logger="nedolm.train.checkpoint"):
        assert latest_checkpoint(tmp_path, require_digest=True) == checkpoint_path(tmp_path, 1)
    [warning] = [record.getMessage() for record in caplog.records]
    assert f"skipping checkpoint: {path} is corrupt: sha256 " in warning


def test_a_sidecarless_checkpoint_with_a_flipped_byte_anywhere_is_never_resumed(
    tmp_path: Path,
) -> None:
    for step in (1, 2):
        path = save_checkpoint(tmp_path, step, _payload(step), keep_last=3, keep_every=0)
        checksum_path(path).unlink()
    size = path.stat().st_size
    comment = size - len(b"nedolm-sha256:") - 64  # the zip comment: marker + hex digest
    end_record = comment - 22  # the zip's end record: magic ... comment length
    for offset in (0, size // 3, size // 2, end_record, comment - 2, comment, size - 1):
        _flip_byte(path, offset)
        assert latest_checkpoint(tmp_path, require_digest=True) == checkpoint_path(tmp_path, 1)
        _flip_byte(path, offset)
        assert latest_checkpoint(tmp_path, require_digest=True) == path


def test_a_checkpoint_without_any_digest_is_skipped_unless_trusted(tmp_path: Path, caplog) -> None:
    """Written before digests existed (plain torch.save) and without its sidecar."""
    save_checkpoint(tmp_path, 1, _payload(1), keep_last=3, keep_every=0)
    bare = checkpoint_path(tmp_path, 2)
    torch.save(_payload(2), bare)
    with caplog.at_level(logging.WARNING, logger="nedolm.train.checkpoint"):
        assert resume_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)
        [skipped] = [record.getMessage() for record in caplog.records]
        assert skipped == (
            f"skipping checkpoint: {bare} carries no digest (no step-00000002.pt.sha256 beside "
            "it and none inside it), so it cannot be verified; restart with --trust-unverified "
            "to resume from it anyway; trying the previous one"
        )
        caplog.clear()
        assert resume_checkpoint(tmp_path, trust_unverified=True) == bare
        [trusted] = [record.getMessage() for record in caplog.records]
        assert (
            trusted == f"resuming from {bare} unverified: it carries no digest (--trust-unverified)"
        )
    assert latest_checkpoint(tmp_path) == bare  # a base run's checkpoints may carry none
    checkpoint_path(tmp_path, 1).unlink()
    checksum_path(checkpoint_path(tmp_path, 1)).unlink()
    with pytest.raises(CheckpointError, match=r"no valid checkpoint in .* carries no digest"):
        resume_checkpoint(tmp_path)


def test_a_sharded_checkpoint_without_digests_is_skipped_unless_trusted(
    tmp_path: Path, caplog
) -> None:
    save_checkpoint(tmp_path, 1, _payload(1), keep_last=3, keep_every=0)
    old = checkpoint_path(tmp_path, 2).with_suffix("")  # format 1: before the digests
    old.mkdir()
    (old / MANIFEST).write_text(json.dumps({"format": 1, "world_size": 1, "meta": {}}))
    torch.save({"step": 2}, old / PAYLOAD)
    checkpoint_path(tmp_path, 3).with_suffix("").mkdir()  # a save that never finished
    with caplog.at_level(logging.WARNING, logger="nedolm.train.checkpoint"):
        assert resume_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)
        assert resume_checkpoint(tmp_path, trust_unverified=True) == old
    warnings = [record.getMessage() for record in caplog.records]
    assert "step-00000003: not a complete sharded checkpoint" in warnings[0]
    assert f"{old} carries no digest (its manifest is format 1, written before" in warnings[1]
    assert (
        warnings[3] == f"resuming from {old} unverified: it carries no digest (--trust-unverified)"
    )


def test_unreadable_checkpoint_is_refused_naming_it(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 7, _payload(7), keep_last=3, keep_every=0)
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CheckpointError, match=r"step-00000007\.pt is corrupt: sha256"):
        load_checkpoint(path)
    checksum_path(path).unlink()  # no checksum (e.g. a pretraining base): torch.load decides
    with pytest.raises(CheckpointError, match=r"cannot read checkpoint .*step-00000007\.pt"):
        load_checkpoint(path)
    torch.save({"not": "a checkpoint"}, path)
    with pytest.raises(CheckpointError, match="no 'model' entry"):
        load_checkpoint(path)


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_one_flipped_byte_anywhere_is_caught(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 1, _payload(1), keep_last=3, keep_every=0)
    size = path.stat().st_size
    for offset in (0, size // 3, size // 2, size - 1):
        _flip_byte(path, offset)
        with pytest.raises(CheckpointError, match=r"is corrupt: sha256 .* does not match"):
            load_checkpoint(path)
        _flip_byte(path, offset)  # flipped back: valid again
        assert load_checkpoint(path)["step"] == 1


def test_resume_skips_invalid_newest_checkpoints_naming_each(tmp_path: Path, caplog) -> None:
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, _payload(step), keep_last=5, keep_every=0)
    _flip_byte(checkpoint_path(tmp_path, 4), 100)
    three = checkpoint_path(tmp_path, 3)
    three.write_bytes(three.read_bytes()[:50])  # truncated
    torch.save({"weights": 1}, checkpoint_path(tmp_path, 2))  # wrong keys, no checksum
    checksum_path(checkpoint_path(tmp_path, 2)).unlink()
    with caplog.at_level(logging.WARNING, logger="nedolm.train.checkpoint"):
        assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3
    assert "skipping checkpoint: " in warnings[0] and "step-00000004.pt is corrupt" in warnings[0]
    assert "step-00000003.pt is corrupt" in warnings[1]
    assert "step-00000002.pt is not a NedoLM checkpoint (no 'model' entry)" in warnings[2]
    checkpoint_path(tmp_path, 1).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no valid checkpoint in ") as refused:
        latest_checkpoint(tmp_path)
    for step in (1, 2, 3, 4):
        assert f"step-{step:08d}.pt" in str(refused.value)


def test_rotation_never_deletes_the_newest_valid_checkpoint(tmp_path: Path) -> None:
    for step in (50, 60):
        save_checkpoint(tmp_path, step, _payload(step), keep_last=2, keep_every=0)
    _flip_byte(checkpoint_path(tmp_path, 60), 10)  # a reused dir whose highest step is corrupt
    save_checkpoint(tmp_path, 3, _payload(3), keep_last=1, keep_every=0)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 50, 60]
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 50)


def test_archive_and_metadata(tmp_path: Path) -> None:
    path = save_model_archive(tmp_path, 4, _payload(4))
    assert path.name == "model-00000004.pt" and load_checkpoint(path)["step"] == 4
    write_run_metadata(tmp_path, {"start_step": 0})
    write_run_metadata(tmp_path, {"start_step": 4})
    meta = json.loads((tmp_path / "run_metadata.json").read_text(encoding="utf-8"))
    assert meta == {"starts": [{"start_step": 0}, {"start_step": 4}]}


_WRITER = """
import sys, torch
from nedolm.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
last = latest_checkpoint(sys.argv[1])
step = load_checkpoint(last)["step"] if last else 0
while True:
    step += 1
    payload = {"model": {"w": torch.full((2_000_000,), float(step))}, "step": step}
    save_checkpoint(sys.argv[1], step, payload, keep_last=2, keep_every=0)
"""


def _latest_step(run_dir: Path) -> int:
    found = list_checkpoints(run_dir)
    return found[-1][0] if found else 0


def test_kill_9_mid_write_never_leaves_a_partial_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(0)
    for _ in range(3):
        before = _latest_step(tmp_path)
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)])
        deadline = time.monotonic() + 120
        while _latest_step(tmp_path) == before:  # this writer's first save (startup varies)
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.5))  # then kill anywhere: mid-write, mid-rename, mid-rotate
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        for step, path in list_checkpoints(tmp_path):
            state = load_checkpoint(path)
            assert state["step"] == step
            assert torch.equal(state["model"]["w"], torch.full((2_000_000,), float(step)))
