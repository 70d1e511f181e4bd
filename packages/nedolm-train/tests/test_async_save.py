"""The parts of asynchronous checkpoints, in process: staging copies, the background writer, and
reading only a checkpoint's model (verified, mapped, released)."""

from __future__ import annotations

import hashlib
import io
import itertools
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from nedolm.model.config import preset
from nedolm.model.model import build_model
from nedolm.train import async_save
from nedolm.train.async_save import BackgroundWrite, StagedCopies, carve, plan_blocks
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


def test_buffers_reserved_by_size_are_the_ones_the_first_stage_fills() -> None:
    """Reserved before the state exists (AdamW's moments, shaped like their parameters): the
    first stage copies into those buffers; a tensor of a size nobody reserved gets a new one."""
    weight, bias = torch.randn(1000), torch.randn(10)
    staging = StagedCopies()
    staging.reserve({"w": weight, "b": bias}, [weight], [weight])  # 4 buffers: w, b, 2 moments
    staging.wait_for_reserve()
    reserved = {s.data_ptr() for spares in staging._spares.values() for s in spares}
    moments = [torch.randn(1000), torch.randn(1000)]  # created after the reservation
    state = {"model": {"w": weight, "b": bias}, "optimizer": [*moments, torch.tensor(3.0)]}
    staged = staging.stage(state)
    big = [staged["model"]["w"], staged["model"]["b"], *staged["optimizer"][:2]]
    assert len(reserved) == 4 and {t.data_ptr() for t in big} == reserved
    assert staged["optimizer"][2].data_ptr() not in reserved  # the step count: not reserved
    for got, want in zip(big, [weight, bias, *moments], strict=True):
        assert torch.equal(got, want)
    assert not staging._spares  # what no tensor took is freed at the first stage


def test_a_reservation_that_fails_is_logged_and_the_stage_allocates_instead(caplog) -> None:
    """A buffer the machine cannot give (a locked-memory limit, say: here 1 PiB) costs the
    first checkpoint its head start, not the run."""
    weight = torch.randn(100)
    staging = StagedCopies()
    with caplog.at_level("WARNING", logger="nedolm.train.async_save"):
        staging.reserve([torch.empty(2**48, device="meta"), weight])
        staging.wait_for_reserve()
    assert "not reserved" in caplog.text and "first checkpoint allocates" in caplog.text
    staged = staging.stage({"w": weight})
    assert torch.equal(staged["w"], weight)


def _saved_bytes(state: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def test_a_staged_state_saves_to_the_bytes_the_state_itself_saves() -> None:
    """The buffers are slices of shared blocks, yet each is a storage of its own: the file
    holds each tensor's bytes once (tied views included), as a save of the state does."""
    weight = torch.randn(5, 7)
    state = {
        "model": {"w": weight, "tied": weight[2:], "t": weight.T, "half": torch.randn(9).half()},
        "optimizer": [torch.arange(11), torch.zeros(0), torch.tensor([True, False])],
        "rng": torch.randn(3, dtype=torch.float64),
        "step": 4,
    }
    staged = StagedCopies().stage(state)
    assert _saved_bytes(staged) == _saved_bytes(state)
    blocks = {t.untyped_storage().data_ptr() for t in (staged["model"]["w"], staged["rng"])}
    assert len(blocks) == 2  # separate storages, though cut from one block


def _check_plan(sizes: list[int], block_sizes: list[int], placements) -> None:
    """Every block a power of two; every buffer page-aligned, inside its block, alone."""
    assert all(n & (n - 1) == 0 for n in block_sizes)
    by_block: dict[int, list[tuple[int, int]]] = {}
    for nbytes, (block, offset) in zip(sizes, placements, strict=True):
        assert offset % async_save.PAGE_BYTES == 0
        by_block.setdefault(block, []).append((offset, nbytes))
    assert sorted(by_block) == list(range(len(block_sizes)))
    for block, spans in by_block.items():
        spans.sort()
        for (offset, nbytes), (next_offset, _) in itertools.pairwise(spans):
            assert offset + nbytes <= next_offset
        assert spans[-1][0] + spans[-1][1] <= block_sizes[block]


def test_buffers_are_carved_from_few_power_of_two_blocks_without_overlap(monkeypatch) -> None:
    """Many sizes (one larger than a block, some empty) cut from blocks: each buffer has its
    size, writes to one leave the others alone, and the blocks hold them tightly."""
    monkeypatch.setattr(async_save, "BLOCK_BYTES", 1 << 16)
    gen = torch.Generator().manual_seed(0)
    sizes = [int(n) for n in torch.randint(1, 20_000, (40,), generator=gen)] + [0, 0, 100_000]
    allocated: list[int] = []

    def allocate(nbytes: int) -> torch.UntypedStorage:
        allocated.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8).untyped_storage()

    buffers = carve(sizes, allocate)
    block_sizes, placements = plan_blocks(sizes)
    assert allocated == block_sizes
    _check_plan(sizes, block_sizes, placements)
    assert [b.nbytes() for b in buffers] == sizes
    for index, buffer in enumerate(buffers):
        buffer.fill_(index % 256)
    # The blocks themselves were dropped: freed memory would now be handed out again.
    others = [torch.full((n,), 255, dtype=torch.uint8) for n in block_sizes]
    for index, buffer in enumerate(buffers):
        assert set(buffer.tolist()) <= {index % 256}
    assert all(bool((other == 255).all()) for other in others)
    pages = sum(-(-n // async_save.PAGE_BYTES) * async_save.PAGE_BYTES for n in sizes)
    assert sum(block_sizes) <= 1.05 * pages  # a power of two per buffer: 1.19x these pages


def test_nedolm_0_8b_and_its_adamw_moments_fit_blocks_within_2_percent_of_their_size() -> None:
    """What ``reserve`` asks for a CUDA run of the 0.8B preset (the parameters in float32 and
    two moments each): blocks within 2% of the state (8.73 GiB), where a pinned buffer per
    tensor, rounded to its power of two, would take 11.44 GiB."""
    model = build_model(preset("nedolm-0.8b"), device="meta", init_weights=False)
    sizes = [p.numel() * p.element_size() for p in model.parameters()] * 3
    block_sizes, placements = plan_blocks(sizes)
    _check_plan(sizes, block_sizes, placements)
    assert sum(block_sizes) <= 1.02 * sum(sizes)
    assert sum(1 << (n - 1).bit_length() for n in sizes) > 1.3 * sum(sizes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine pins: nothing to fall back")
def test_pinned_memory_the_machine_refuses_is_replaced_by_pageable_memory(caplog) -> None:
    """A CUDA run that may not pin (a locked-memory limit; here a torch with no pinned allocator
    at all) stages into pageable memory and says so once, rather than failing at its first
    checkpoint."""
    staging = StagedCopies()
    with caplog.at_level("WARNING", logger="nedolm.train.async_save"):
        first = staging._new_buffer(pinned=True, nbytes=64)
        second = staging._new_buffer(pinned=True, nbytes=32)
    assert (first.nbytes(), second.nbytes()) == (64, 32)
    # Asked through a tensor view: UntypedStorage.is_pinned() warns on torch 2.10 and 2.11.
    assert first.device.type == "cpu"
    assert not torch.empty(0, dtype=torch.uint8).set_(first).is_pinned()
    assert caplog.text.count("pinned memory refused") == 1, caplog.text
    assert "stage into pageable memory" in caplog.text


EXIT_WHILE_RESERVING = """
import sys, torch
from nedolm.train.async_save import StagedCopies
StagedCopies().reserve([torch.empty(2**26 + i) for i in range(4)])  # 1 GiB being zeroed
sys.exit(3)
"""


def test_a_process_exiting_while_buffers_are_reserved_keeps_its_exit_code() -> None:
    """A run that ends (or fails) during the reservation exits with its own code: a daemon
    allocation thread made the interpreter's teardown abort (134, "terminate called")."""
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_WHILE_RESERVING], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 3, proc.stderr[-2000:]


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
