"""The parts of asynchronous checkpoints, in process: staging copies, the background writer, and
reading only a checkpoint's model (verified, mapped, released)."""

from __future__ import annotations

import hashlib
import re
import threading
from pathlib import Path

import pytest
import torch

from nedolm.train.async_save import BackgroundWrite, StagedCopies
from nedolm.train.checkpoint import (
    MODEL_DIGEST,
    CheckpointError,
    load_checkpoint,
    newest_model_checkpoint,
    read_model_checkpoint,
    save_checkpoint,
)
from nedolm.train.checksum import checksum_path

MODEL_FILL = 0.123456789  # distinctive float32 bytes, found again in the file
OPTIM_FILL = 9.87654321


def test_staged_copies_are_owned_keep_tied_storage_and_reuse_buffers() -> None:
    weight = torch.randn(4, 3)
    shared_view = weight[1:]  # a view into the same storage (tied weights are one storage)
    state = {"model": {"w": weight, "tied": shared_view}, "rng": [torch.arange(3)], "step": 7}
    staging = StagedCopies()
    staged = staging.stage(state)
    expected = weight.clone()
    weight.mul_(2)  # training goes on, in place
    assert torch.equal(staged["model"]["w"], expected)
    assert torch.equal(staged["model"]["tied"], expected[1:])
    tied_storage = staged["model"]["tied"].untyped_storage().data_ptr()
    assert tied_storage == staged["model"]["w"].untyped_storage().data_ptr()
    assert staged["step"] == 7 and torch.equal(staged["rng"][0], torch.arange(3))
    buffer = staged["model"]["w"].untyped_storage().data_ptr()
    again = staging.stage(state)  # the next checkpoint reuses the buffer, with the new values
    assert again["model"]["w"].untyped_storage().data_ptr() == buffer
    assert torch.equal(again["model"]["w"], weight)


def test_reserved_buffers_are_the_ones_the_first_stage_fills() -> None:
    state = {"model": {"w": torch.randn(1000)}, "optimizer": [torch.randn(10, 10)]}
    staging = StagedCopies()
    staging.reserve(state)
    staging._wait_for_reserve()
    reserved = {buffer.data_ptr() for buffer in staging._buffers.values()}
    staged = staging.stage(state)
    used = {staged["model"]["w"].data_ptr(), staged["optimizer"][0].data_ptr()}
    assert len(reserved) == 2 and used == reserved
    assert torch.equal(staged["optimizer"][0], state["optimizer"][0])


def test_a_background_write_runs_one_at_a_time_and_hands_its_failure_to_collect() -> None:
    writer = BackgroundWrite()
    release = threading.Event()
    writer.submit("slow", release.wait)
    assert writer.in_flight and not writer.finished()
    with pytest.raises(RuntimeError, match="still in flight"):
        writer.submit("second", lambda: None)
    release.set()
    assert writer.collect() >= 0 and not writer.in_flight

    def fail() -> None:
        raise OSError(28, "No space left on device")

    writer.submit("failing", fail)
    with pytest.raises(OSError, match="No space left"):
        writer.collect()
    assert not writer.in_flight  # reported once


def _training_payload() -> dict:
    return {
        "step": 3,
        "model": {"w": torch.full((4096,), MODEL_FILL), "b": torch.zeros(7)},
        "optimizer": {"state": {0: {"exp_avg": torch.full((4096,), OPTIM_FILL)}}},
    }


def _flip_inside(path: Path, fill: float) -> None:
    """Flip one byte in the middle of the tensor filled with ``fill``."""
    data = bytearray(path.read_bytes())
    pattern = torch.full((64,), fill).numpy().tobytes()
    at = data.find(pattern)
    assert at > 0, "tensor bytes not found in the file"
    data[at + 100] ^= 0x01
    path.write_bytes(bytes(data))


def test_reading_the_model_never_reads_the_optimizer_state(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 3, _training_payload(), keep_last=2, keep_every=0)
    _flip_inside(path, OPTIM_FILL)  # damage where only a full read would look
    with pytest.raises(CheckpointError, match="is corrupt"):
        load_checkpoint(path)
    state = read_model_checkpoint(path)
    assert torch.equal(state["model"]["w"], torch.full((4096,), MODEL_FILL))


def test_a_flipped_byte_in_the_model_is_caught_and_the_previous_checkpoint_used(
    tmp_path: Path,
) -> None:
    save_checkpoint(tmp_path, 2, _training_payload(), keep_last=5, keep_every=0)
    newest = save_checkpoint(tmp_path, 3, _training_payload(), keep_last=5, keep_every=0)
    _flip_inside(newest, MODEL_FILL)
    with pytest.raises(
        CheckpointError, match=re.escape(f"{newest} is corrupt: model tensors sha256")
    ):
        read_model_checkpoint(newest)
    found = newest_model_checkpoint(tmp_path)
    assert found is not None and found[0].name == "step-00000002.pt"


def test_a_checkpoint_of_an_earlier_version_is_verified_whole(tmp_path: Path) -> None:
    """Written before the model digest: torch.save and a sidecar, as earlier versions did."""
    path = tmp_path / "checkpoints" / "step-00000001.pt"
    path.parent.mkdir(parents=True)
    torch.save(_training_payload(), path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    checksum_path(path).write_text(f"{digest}\n", encoding="ascii")
    state = read_model_checkpoint(path)
    assert MODEL_DIGEST not in state and torch.equal(state["model"]["b"], torch.zeros(7))
    del state
    _flip_inside(path, OPTIM_FILL)
    with pytest.raises(CheckpointError, match=r"does not match step-00000001\.pt\.sha256"):
        read_model_checkpoint(path)


def _maps_and_fds_naming(path: Path) -> list[str]:
    maps = Path("/proc/self/maps").read_text().splitlines()
    fds = [str(p.readlink()) for p in Path("/proc/self/fd").iterdir() if p.is_symlink()]
    return [line for line in maps + fds if str(path) in line]


def test_nothing_stays_mapped_or_open_once_the_weights_are_copied_out(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 3, _training_payload(), keep_last=2, keep_every=0)
    model = torch.nn.Module()
    model.register_buffer("w", torch.zeros(4096))
    model.register_buffer("b", torch.ones(7))
    state = read_model_checkpoint(path)
    assert _maps_and_fds_naming(path), "read_model_checkpoint is expected to map the file"
    model.load_state_dict(state["model"])
    del state
    assert _maps_and_fds_naming(path) == []
    resumed = load_checkpoint(path, mmap=False)  # a resume's read: owned memory from the start
    assert _maps_and_fds_naming(path) == []
    assert torch.equal(resumed["optimizer"]["state"][0]["exp_avg"], torch.full((4096,), OPTIM_FILL))
