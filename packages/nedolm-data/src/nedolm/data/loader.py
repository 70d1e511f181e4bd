"""The training loader: packed windows as micro-batches, shuffled per epoch, resumable exactly.

The stream is a pure function of (plan, seed, rank, world_size, micro_batch_size):

* every epoch ``e`` shuffles all windows of the given shards with
  ``np.random.default_rng([seed, e]).permutation``; rank ``r`` takes ``perm[r::world_size]``;
* a rank's epochs are concatenated into one endless sequence of windows, cut into batches of
  ``micro_batch_size`` (a batch may straddle two epochs: epochs continue seamlessly);
* with ``num_workers`` workers, worker ``w`` builds batches ``start + w``,
  ``start + w + num_workers``, ... which the DataLoader hands out round-robin from worker 0,
  so the batch order does not depend on the number of workers.

Every row of a batch carries a state row ``[global worker id, epoch, cursor, batch, plan
fingerprint, seq_len, world_size, num_workers, micro_batch_size, seed]`` describing the stream
just after that row. The worker id is ``rank * num_workers + batch % num_workers``: the worker
that builds the batch in an uninterrupted run, so states are identical after a resume too (a
resumed loader's worker 0 may build another residue class). The trainer keeps the last row per
worker and passes them back as ``resume_state``: the largest ``batch`` in it is the last batch
consumed, so the resumed loader starts at the next one and yields exactly the batches the
uninterrupted run would have.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from nedolm.data.format import read_special_tokens
from nedolm.data.packing import (
    PlannedShard,
    discover_sft_shards,
    flat_ranges,
    plan_fingerprint,
    target_ranges,
)

STATE_COLUMNS = (
    "worker",
    "epoch",
    "cursor",
    "batch",
    "fingerprint",
    "seq_len",
    "world_size",
    "num_workers",
    "micro_batch_size",
    "seed",
)
"""Columns of a state row; ``cursor`` = windows of ``epoch`` this rank has consumed."""

# Checked in this order, so a changed seq_len is reported as such, not as another plan.
_CHECKED = ("seq_len", "world_size", "num_workers", "micro_batch_size", "seed", "fingerprint")
_WHAT = {
    "fingerprint": "corpus plan fingerprint (another corpus, shard set or plan)",
    "seq_len": "seq_len",
    "world_size": "world_size",
    "num_workers": "num_workers",
    "micro_batch_size": "micro_batch_size",
    "seed": "seed",
}


class LoaderStateError(ValueError):
    """A resume state that cannot restore this loader's stream; says which setting differs."""


class _ShardWindows:
    """One shard's windows in gather-ready form: per piece its shard-token source, its
    offset in the row, and its target spans clipped to the piece, in row coordinates."""

    def __init__(self, planned: PlannedShard) -> None:
        shard, pieces = planned.shard, planned.plan.pieces
        self.tokens = shard.tokens
        self.offsets = planned.plan.window_offsets.astype(np.int64)
        base = shard.index["token_start"].astype(np.int64)[pieces["doc"]]
        self.src = base + pieces["start"]
        self.length = length = pieces["end"].astype(np.int64) - pieces["start"]
        # Row offset of each piece: running length, restarted at every window.
        self.dst = np.cumsum(length) - length
        self.dst -= np.repeat(self.dst[self.offsets[:-1]], np.diff(self.offsets))
        # Target spans of every piece, clipped to [max(start, target_from), end).
        ranges = target_ranges(shard.index, shard.segments)
        span_end = ranges.start + ranges.length
        lo = base + np.maximum(pieces["start"], pieces["target_from"])
        hi = base + pieces["end"]
        first = np.searchsorted(span_end, lo, side="right")
        last = np.searchsorted(ranges.start, hi, side="left")
        per_piece = np.maximum(last - first, 0)
        piece_of = np.repeat(np.arange(len(pieces)), per_piece)
        span = np.repeat(first, per_piece) + flat_ranges(per_piece)
        shift = self.dst[piece_of] - self.src[piece_of]  # shard position -> row position
        self.mask_start = np.maximum(ranges.start[span], lo[piece_of]) + shift
        self.mask_end = np.minimum(span_end[span], hi[piece_of]) + shift
        window_of_piece = np.repeat(np.arange(len(self.offsets) - 1), np.diff(self.offsets))
        self.mask_offsets = np.searchsorted(
            window_of_piece[piece_of], np.arange(len(self.offsets)), side="left"
        )

    def fill(self, window: int, tokens_row: np.ndarray, spans: list[np.ndarray]) -> None:
        """Copy one window's tokens into ``tokens_row``; append its target spans."""
        p0, p1 = self.offsets[window], self.offsets[window + 1]
        for src, dst, n in zip(
            self.src[p0:p1].tolist(),
            self.dst[p0:p1].tolist(),
            self.length[p0:p1].tolist(),
            strict=True,
        ):
            tokens_row[dst : dst + n] = self.tokens[src : src + n]
        m0, m1 = self.mask_offsets[window], self.mask_offsets[window + 1]
        spans.append(np.stack([self.mask_start[m0:m1], self.mask_end[m0:m1]]))


class SFTWindowDataset(IterableDataset):
    """This rank's endless stream of micro-batches (see the module docstring)."""

    def __init__(
        self,
        shards: Sequence[PlannedShard],
        seq_len: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        num_workers: int,
        seed: int,
        pad_id: int,
        resume_state: Mapping[int | str, Sequence[int]] | None = None,
    ) -> None:
        super().__init__()
        if not shards:
            raise ValueError("no shards to load")
        if micro_batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need micro_batch_size >= 1 and 0 <= rank < world_size, got "
                f"micro_batch_size={micro_batch_size}, rank={rank}, world_size={world_size}"
            )
        for s in shards:
            if s.seq_len != seq_len:
                raise ValueError(f"{s.token_path}: planned for seq_len {s.seq_len}, not {seq_len}")
        self.shards = list(shards)
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.num_workers = num_workers
        self.seed = seed
        self.pad_id = pad_id
        counts = [s.plan.counts.windows for s in self.shards]
        self.shard_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.total_windows = int(self.shard_offsets[-1])
        self.windows_per_epoch = len(range(rank, self.total_windows, world_size))
        if self.windows_per_epoch == 0:
            raise ValueError(
                f"rank {rank} of {world_size} gets no window: the shards hold only "
                f"{self.total_windows} windows"
            )
        self.fingerprint = plan_fingerprint(self.shards)
        self.start_batch = self._resume_batch(resume_state) if resume_state else 0
        self._windows: list[_ShardWindows] | None = None  # built lazily in each process

    def settings(self) -> dict[str, int]:
        """The values a state row must match to resume this stream."""
        return {
            "fingerprint": self.fingerprint,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "micro_batch_size": self.micro_batch_size,
            "seed": self.seed,
        }

    def _resume_batch(self, resume_state: Mapping[int | str, Sequence[int]]) -> int:
        """Validate the trainer's ``{worker: last state row}``; the first batch to produce."""
        expected = self.settings()
        workers = max(1, self.num_workers)
        own = range(self.rank * workers, (self.rank + 1) * workers)
        last = -1
        for key, row in resume_state.items():
            if len(row) != len(STATE_COLUMNS):
                raise LoaderStateError(
                    f"resume state row for worker {key} has {len(row)} columns, "
                    f"expected {len(STATE_COLUMNS)} {STATE_COLUMNS}"
                )
            state = dict(zip(STATE_COLUMNS, (int(v) for v in row), strict=True))
            for name in _CHECKED:
                if state[name] != expected[name]:
                    raise LoaderStateError(
                        f"resume state was saved with {_WHAT[name]}={state[name]}, "
                        f"this loader has {expected[name]}; resume with the original "
                        "settings or start a fresh run"
                    )
            if int(key) != state["worker"] or state["worker"] not in own:
                raise LoaderStateError(
                    f"resume state row for worker {key} names worker {state['worker']}, "
                    f"not one of rank {self.rank}'s workers {list(own)}"
                )
            position = state["epoch"] * self.windows_per_epoch + state["cursor"]
            batch = state["batch"]
            if not batch * self.micro_batch_size < position <= (batch + 1) * self.micro_batch_size:
                raise LoaderStateError(
                    f"resume state row for worker {key} is inconsistent: epoch "
                    f"{state['epoch']} cursor {state['cursor']} after batch {state['batch']}"
                )
            last = max(last, state["batch"])
        return last + 1

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        if max(1, self.num_workers) != workers:
            raise RuntimeError(
                f"dataset built for num_workers={self.num_workers}, run by {workers} workers"
            )
        if self._windows is None:
            self._windows = [_ShardWindows(s) for s in self.shards]
        batch = self.start_batch + worker
        while True:
            yield self._batch(batch)
            batch += workers

    def epoch_windows(self, epoch: int) -> np.ndarray:
        """Global window ids this rank trains in ``epoch``, in order."""
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.total_windows)
        return perm[self.rank :: self.world_size]

    def _batch(self, batch: int) -> dict[str, torch.Tensor]:
        size, row_len = self.micro_batch_size, self.seq_len + 1
        positions = np.arange(batch * size, (batch + 1) * size, dtype=np.int64)
        epochs = positions // self.windows_per_epoch
        cursors = positions % self.windows_per_epoch
        windows = np.empty(size, np.int64)
        for epoch in np.unique(epochs).tolist():
            rows = epochs == epoch
            windows[rows] = self.epoch_windows(epoch)[cursors[rows]]
        shard_of = np.searchsorted(self.shard_offsets, windows, side="right") - 1

        tokens = np.full((size, row_len), self.pad_id, np.int64)
        spans: list[np.ndarray] = []
        assert self._windows is not None
        for row, (shard, window) in enumerate(
            zip(shard_of.tolist(), windows.tolist(), strict=True)
        ):
            self._windows[shard].fill(window - int(self.shard_offsets[shard]), tokens[row], spans)
        # Mask from spans: +1 at each span start, -1 at its end, cumulative sum > 0.
        flat = np.concatenate([s + row * row_len for row, s in enumerate(spans)], axis=1)
        delta = np.bincount(flat[0], minlength=size * row_len + 1) - np.bincount(
            flat[1], minlength=size * row_len + 1
        )
        mask = (np.cumsum(delta[:-1]) > 0).reshape(size, row_len)

        after = positions + 1
        state = np.empty((size, len(STATE_COLUMNS)), np.int64)
        state[:, 0] = self.rank * max(1, self.num_workers) + batch % max(1, self.num_workers)
        state[:, 1] = after // self.windows_per_epoch
        state[:, 2] = after % self.windows_per_epoch
        state[:, 3] = batch
        state[:, 4:] = [self.settings()[name] for name in STATE_COLUMNS[4:]]
        return {
            "tokens": torch.from_numpy(tokens),
            "trainable_mask": torch.from_numpy(mask),
            "trainable_tokens": torch.from_numpy(mask.sum(axis=1)),
            "state": torch.from_numpy(state),
        }


def build_sft_loader(
    data_dir: Path | str | None,
    seq_len: int,
    micro_batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    prefetch_factor: int = 2,
    seed: int = 0,
    resume_state: Mapping[int | str, Sequence[int]] | None = None,
    shards: Sequence[PlannedShard] | None = None,
    persistent_workers: bool = False,
    pad_id: int | None = None,
) -> tuple[DataLoader, SFTWindowDataset]:
    """An endless DataLoader of this rank's micro-batches, and the dataset behind it.

    Batches: ``tokens`` [B, S+1] int64 (pad = the corpus pad id), ``trainable_mask`` [B, S+1]
    bool (token j is a target; never a pad, never column 0), ``trainable_tokens`` [B] int64,
    ``state`` [B, 10] int64 (columns ``STATE_COLUMNS``).

    Args:
        data_dir: corpus directory; its shards are planned unless ``shards`` is given, and its
            SPECIAL_TOKENS.json supplies the pad id unless ``pad_id`` is given.
        seq_len: rows hold ``seq_len + 1`` tokens.
        micro_batch_size: rows per batch.
        rank, world_size: this process's share of every epoch.
        num_workers: DataLoader worker processes (0: in the main process). Part of the state.
        prefetch_factor: batches each worker prepares ahead.
        seed: shuffling seed. Part of the state.
        resume_state: ``{global worker id: last state row seen}`` from an earlier run.
        shards: planned shards (from ``discover_sft_shards``), e.g. the training split.
        persistent_workers: keep workers alive between iterations.
        pad_id: padding token id.

    Raises:
        LoaderStateError: ``resume_state`` belongs to another corpus, seq_len, world size,
            worker count, micro-batch size or seed (the message says which).
    """
    if shards is None:
        if data_dir is None:
            raise ValueError("build_sft_loader needs data_dir or shards")
        shards = discover_sft_shards(Path(data_dir), seq_len)
    if pad_id is None:
        if data_dir is None:
            raise ValueError("build_sft_loader needs data_dir (for SPECIAL_TOKENS.json) or pad_id")
        pad_id = read_special_tokens(Path(data_dir)).pad_id
    dataset = SFTWindowDataset(
        shards,
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
        seed=seed,
        pad_id=pad_id,
        resume_state=resume_state,
    )
    workers = {}
    if num_workers > 0:
        workers = {
            "prefetch_factor": prefetch_factor,
            "persistent_workers": persistent_workers,
            "worker_init_fn": ignore_stop_signals,
        }
    loader = DataLoader(
        dataset,
        batch_size=None,  # the dataset yields whole micro-batches
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        **workers,
    )
    return loader, dataset


def ignore_stop_signals(_worker_id: int) -> None:
    """Workers ignore SIGTERM/SIGINT: the main process gets them and checkpoints first."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
