"""The loader against a token-by-token assembly of the plan, and epoch coverage over ranks."""

import multiprocessing
import os
import signal
import subprocess
import sys
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from nedolm.data.loader import build_sft_loader
from nedolm.data.loader_workers import StopSignalGuard
from nedolm.data.packing import PlannedShard, discover_sft_shards
from nedolm.data.synthetic import PAD_ID, UNIQUE_BASE_ID, random_conversations, write_corpus

SEQ_LEN = 40


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three shards, some documents longer than a window (chains); token id = position."""
    data_dir = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(3)
    write_corpus(
        data_dir, [random_conversations(rng, 30, 12) for _ in range(3)], unique_tokens=True
    )
    return data_dir


def slow_row(shard: PlannedShard, window: int) -> tuple[list[int], list[bool]]:
    """One window's tokens and target flags, token by token from the records."""
    index, segments, tokens = shard.shard.index, shard.shard.segments, shard.shard.tokens
    row, mask = [], []
    for piece in shard.plan.pieces[shard.plan.pieces["window"] == window]:
        doc = int(piece["doc"])
        first = int(index["segment_start"][doc])
        messages = segments[first : first + int(index["segment_count"][doc])]
        targets = {
            p
            for m in messages
            if m["trainable"]
            for p in range(int(m["start"] + m["header_len"]), int(m["start"] + m["length"]))
        }
        for pos in range(int(piece["start"]), int(piece["end"])):
            row.append(int(tokens[int(index["token_start"][doc]) + pos]))
            mask.append(pos >= int(piece["target_from"]) and pos in targets)
    pad = SEQ_LEN + 1 - len(row)
    return row + [PAD_ID] * pad, mask + [False] * pad


def rank_windows(shards: list[PlannedShard], seed: int, rank: int, world: int, epochs: int):
    """The documented order: per epoch default_rng([seed, epoch]).permutation, rank::world."""
    counts = [s.plan.counts.windows for s in shards]
    offsets = np.cumsum([0, *counts])
    for epoch in range(epochs):
        for g in np.random.default_rng([seed, epoch]).permutation(offsets[-1])[rank::world]:
            shard = int(np.searchsorted(offsets, g, side="right") - 1)
            yield shards[shard], int(g - offsets[shard])


def test_rows_match_token_by_token_assembly(corpus: Path) -> None:
    shards = discover_sft_shards(corpus, SEQ_LEN)
    loader, dataset = build_sft_loader(
        corpus, SEQ_LEN, micro_batch_size=3, rank=1, world_size=2, seed=5, shards=shards
    )
    batches = -(-2 * dataset.windows_per_epoch // 3) + 1  # past the end of epoch 1
    expected = rank_windows(shards, seed=5, rank=1, world=2, epochs=3)
    for batch in islice(loader, batches):
        assert batch["tokens"].dtype == torch.int64 and batch["tokens"].shape == (3, SEQ_LEN + 1)
        assert batch["trainable_mask"].dtype == torch.bool
        for row in range(3):
            tokens, mask = slow_row(*next(expected))
            assert batch["tokens"][row].tolist() == tokens
            assert batch["trainable_mask"][row].tolist() == mask
        assert batch["trainable_tokens"].tolist() == batch["trainable_mask"].sum(1).tolist()
        assert not batch["trainable_mask"][:, 0].any()


@pytest.mark.parametrize(
    ("world_size", "num_workers", "micro_batch"), [(1, 0, 4), (2, 2, 3), (3, 1, 5)]
)
def test_one_epoch_over_ranks_trains_every_target_once(
    corpus: Path, world_size: int, num_workers: int, micro_batch: int
) -> None:
    shards = discover_sft_shards(corpus, SEQ_LEN)
    shard_ranges = []  # token-id range of each shard
    all_targets = []
    for s in shards:
        base = UNIQUE_BASE_ID + sum(int(x.shard.tokens.size) for x in shards[: s.shard_id])
        shard_ranges.append((base, base + int(s.shard.tokens.size)))
        index, segments = s.shard.index, s.shard.segments
        for doc in range(len(index)):
            first = int(index["segment_start"][doc])
            for m in segments[first : first + int(index["segment_count"][doc])]:
                if m["trainable"]:
                    start = base + int(index["token_start"][doc]) + int(m["start"])
                    all_targets += range(start + int(m["header_len"]), start + int(m["length"]))
    emitted = []
    for rank in range(world_size):
        loader, dataset = build_sft_loader(
            corpus, SEQ_LEN, micro_batch, rank=rank, world_size=world_size,
            num_workers=num_workers, seed=11, shards=shards,
        )  # fmt: skip
        rows = []
        for batch in loader:
            for tokens, mask in zip(batch["tokens"], batch["trainable_mask"], strict=True):
                rows.append((tokens, mask))
            if len(rows) >= dataset.windows_per_epoch:
                break
        for tokens, mask in rows[: dataset.windows_per_epoch]:
            real = tokens[tokens != PAD_ID]
            lo, hi = next(r for r in shard_ranges if r[0] <= int(real[0]) < r[1])
            assert bool(((real >= lo) & (real < hi)).all()), "a window mixes shards"
            emitted += tokens[mask].tolist()
    assert len(emitted) == len(set(emitted)), "a target was emitted twice in one epoch"
    assert sorted(emitted) == sorted(all_targets)


def test_pad_id_comes_from_special_tokens_and_memory_is_pinned_with_cuda(corpus: Path) -> None:
    loader, dataset = build_sft_loader(corpus, SEQ_LEN, micro_batch_size=2)
    assert dataset.pad_id == PAD_ID
    assert loader.dataloader.pin_memory == torch.cuda.is_available()
    _, custom = build_sft_loader(corpus, SEQ_LEN, micro_batch_size=2, pad_id=9)
    assert custom.pad_id == 9


def test_workers_ignore_sigterm(corpus: Path) -> None:
    loader, _ = build_sft_loader(corpus, SEQ_LEN, micro_batch_size=2, num_workers=2)
    assert isinstance(loader.dataloader.worker_init_fn, StopSignalGuard)
    before = set(multiprocessing.active_children())
    stream = iter(loader)  # starts the workers (the trainer relies on it to fail early)
    workers = [p for p in multiprocessing.active_children() if p not in before]
    assert len(workers) == 2
    # Batches alternate between the workers: once each has delivered one, each has run its
    # worker_init_fn (a signal before that hits the parent's handlers, not the guard).
    first = [next(stream) for _ in workers]
    for worker in workers:
        os.kill(worker.pid, signal.SIGTERM)
        os.kill(worker.pid, signal.SIGINT)
    later = [next(stream) for _ in range(5)]  # a dead worker would raise here
    assert all(w.is_alive() for w in workers)
    assert [int(b["state"][-1, 3]) for b in [*first, *later]] == list(range(7))
    del stream


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["return", "raise"])
def test_main_process_exits_with_live_workers(corpus: Path, ending: str) -> None:
    # multiprocessing ends daemon workers with SIGTERM at exit and joins them: a worker that
    # still ignored SIGTERM then would hang the exit forever.
    script = f"""
import sys
from nedolm.data.loader import build_sft_loader
loader, _ = build_sft_loader(sys.argv[1], {SEQ_LEN}, micro_batch_size=2, num_workers=2)
stream = iter(loader)  # a module global: still alive when the interpreter exits
next(stream)
if sys.argv[2] == "raise":
    raise SystemExit("stopping with live workers")
"""
    result = subprocess.run(
        [sys.executable, "-c", script, str(corpus), ending],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == (0 if ending == "return" else 1), result.stderr
