"""Benchmark the training loader against raw memmap copies of the same bytes, in one run.

    python bench/loader.py [--conversations 200000] [--seq-len 4096] [--micro-batch 8]

Writes a synthetic corpus (conversation shapes and lengths from bench/packing_lengths.json)
to a temporary directory, then measures tokens/s (row tokens, B * (S + 1) per batch):

* ``memmap rows``: for the same windows, copy ``S + 1`` contiguous tokens per row from the
  shard memmap into an int64 [B, S + 1] array (what a plan-free pretraining loader does);
* ``memmap pieces``: copy exactly the loader's pieces (same bytes) into that array, no masks;
* ``loader``: ``build_sft_loader`` batches (tokens, masks, counts, state) through a
  DataLoader with 0 and 2 workers;
* ``DataLoader transport``: 2 workers yielding empty buffers of the same size, i.e. the cost
  of moving a batch between processes alone (the ceiling for any loader with workers).

Medians of ``--repeats`` timed passes over ``--batches`` batches each (after a warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from nedolm.data.loader import build_sft_loader
from nedolm.data.packing import discover_sft_shards
from nedolm.data.synthetic import sample_conversations, write_corpus

LENGTHS_FILE = Path(__file__).with_name("packing_lengths.json")


def batch_windows(dataset, batches: int) -> list[list[tuple[int, int]]]:
    """(shard, window) of every row of the first ``batches`` batches, in the loader's order."""
    order = dataset.epoch_windows(0)
    order = np.concatenate([order, dataset.epoch_windows(1)])[: batches * dataset.micro_batch_size]
    shard = np.searchsorted(dataset.shard_offsets, order, side="right") - 1
    local = order - dataset.shard_offsets[shard]
    rows = list(zip(shard.tolist(), local.tolist(), strict=True))
    size = dataset.micro_batch_size
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def memmap_rows(shards, batches, row_len: int) -> float:
    start = time.perf_counter()
    for batch in batches:
        out = np.empty((len(batch), row_len), np.int64)
        for row, (s, w) in enumerate(batch):
            tokens = shards[s].shard.tokens
            first = w * (row_len - 1) % (len(tokens) - row_len)  # window w of a chunked shard
            out[row] = tokens[first : first + row_len]
    return time.perf_counter() - start


def memmap_pieces(shards, batches, row_len: int) -> float:
    tables = []
    for s in shards:
        pieces, offsets = s.plan.pieces, s.plan.window_offsets
        src = s.shard.index["token_start"].astype(np.int64)[pieces["doc"]] + pieces["start"]
        length = (pieces["end"].astype(np.int64) - pieces["start"]).tolist()
        tables.append((s.shard.tokens, offsets.tolist(), src.tolist(), length))
    start = time.perf_counter()
    for batch in batches:
        out = np.empty((len(batch), row_len), np.int64)
        for row, (s, w) in enumerate(batch):
            tokens, offsets, src, length = tables[s]
            dst = 0
            for p in range(offsets[w], offsets[w + 1]):
                out[row, dst : dst + length[p]] = tokens[src[p] : src[p] + length[p]]
                dst += length[p]
    return time.perf_counter() - start


class TransportOnly(IterableDataset):
    """Yields an empty buffer of one packed batch's size: the DataLoader's own cost."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield torch.empty(self.nbytes, dtype=torch.uint8)


def loader_pass(loader: Iterable, batches: int, workers: int) -> float:
    stream = iter(loader)
    for _ in range(max(1, workers)):  # every worker has built its tables before the timing
        next(stream)
    start = time.perf_counter()
    for _ in islice(stream, batches):
        pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=200_000)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    params = json.loads(LENGTHS_FILE.read_text(encoding="utf-8"))
    row_len = args.seq_len + 1
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        per_shard = args.conversations // 4
        write_corpus(data_dir, [sample_conversations(params, per_shard, seed=i) for i in range(4)])
        shards = discover_sft_shards(data_dir, args.seq_len)
        tokens = sum(int(s.shard.tokens.size) for s in shards)
        windows = sum(s.plan.counts.windows for s in shards)
        print(
            f"corpus: {args.conversations:,} conversations, {tokens:,} tokens, {windows:,} windows"
        )
        results: dict[str, list[float]] = {}
        for workers in (0, 2):
            loader, dataset = build_sft_loader(
                data_dir, args.seq_len, args.micro_batch, num_workers=workers,
                prefetch_factor=4, shards=shards,
            )  # fmt: skip
            results[f"loader, {workers} workers"] = [
                loader_pass(loader, args.batches, workers) for _ in range(args.repeats)
            ]
        transport = DataLoader(
            TransportOnly(dataset.layout.nbytes), batch_size=None, num_workers=2, prefetch_factor=4
        )
        results["DataLoader transport, 2 workers"] = [
            loader_pass(transport, args.batches, 2) for _ in range(args.repeats)
        ]
        batches = batch_windows(dataset, args.batches)
        results["memmap rows"] = [
            memmap_rows(shards, batches, row_len) for _ in range(args.repeats)
        ]
        results["memmap pieces"] = [
            memmap_pieces(shards, batches, row_len) for _ in range(args.repeats)
        ]
    row_tokens = args.batches * args.micro_batch * row_len
    rate = {name: row_tokens / statistics.median(times) for name, times in results.items()}
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'':<32} {'tokens/s':>14} {'vs rows':>8} {'vs pieces':>9}")
    for name, value in rate.items():
        print(
            f"{name:<32} {value:>14,.0f} {value / rate['memmap rows']:>8.2f} "
            f"{value / rate['memmap pieces']:>9.2f}"
        )


if __name__ == "__main__":
    main()
