"""The training loader: packed windows as micro-batches, shuffled per epoch, resumable exactly.

The stream is a pure function of (plan, seed, rank, world_size, micro_batch_size):

* each rank trains its share of every epoch's shuffled windows, after an elastic resume's
  prefix (``nedolm.data.window_stream``), as one endless sequence of windows cut into batches of
  ``micro_batch_size`` (a batch may straddle two epochs: epochs continue seamlessly);
* with ``num_workers`` workers, worker ``w`` builds batches ``start + w``,
  ``start + w + num_workers``, ... which the DataLoader hands out round-robin from worker 0,
  so the batch order does not depend on the number of workers.

Every row of a batch carries a state row ``[global worker id, epoch, cursor, batch, plan
fingerprint, seq_len, world_size, num_workers, micro_batch_size, seed]`` describing the stream
just after that row. The worker id is ``rank * num_workers + batch % num_workers``: the worker
that builds the batch in an uninterrupted run, so states are identical after a resume too (a
resumed loader's worker 0 may build another residue class). The state rows travel inside the
batch because with DataLoader workers only the worker knows where its stream stands; the
``SFTLoader`` keeps the last row per worker as batches pass through it and owns them as its
``state_dict()``. ``load_state_dict`` (or ``resume_state``) hands them back: the largest
``batch`` in it is the last batch consumed, so the resumed loader starts at the next one and
yields exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from nedolm.data.format import read_special_tokens
from nedolm.data.loader_workers import StopSignalGuard, worker_start_method
from nedolm.data.packing import (
    PlannedShard,
    discover_sft_shards,
    flat_ranges,
    plan_fingerprint,
    target_ranges,
)
from nedolm.data.window_stream import WindowStream, remaining_windows

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
    """One shard's windows in gather-ready form, built once per process.

    Per piece: ``shift`` turns a row position into its shard-token position; per window: its
    token count. Per target span (clipped to its piece's ``[max(start, target_from), end)``):
    its row start and length. Pieces and spans are grouped by window (CSR offsets), so a batch
    row is a few slices and one fancy-index gather, never a per-token loop.
    """

    def __init__(self, planned: PlannedShard) -> None:
        shard, pieces = planned.shard, planned.plan.pieces
        self.tokens = np.asarray(shard.tokens)  # plain view: np.memmap slicing runs Python hooks
        self.offsets = planned.plan.window_offsets.astype(np.int64)
        pieces_per_window = np.diff(self.offsets)
        base = shard.index["token_start"].astype(np.int64)[pieces["doc"]]
        src = base + pieces["start"]
        self.length = pieces["end"].astype(np.int64) - pieces["start"]
        # Row offset of each piece: running length, restarted at every window.
        end = np.cumsum(self.length)
        window_start = np.concatenate([[0], end])[self.offsets[:-1]]
        dst = end - self.length - np.repeat(window_start, pieces_per_window)
        self.shift = src - dst
        self.window_len = np.concatenate([[0], end])[self.offsets[1:]] - window_start
        ranges = target_ranges(shard.index, shard.segments)
        span_end = ranges.start + ranges.length
        lo = base + np.maximum(pieces["start"], pieces["target_from"])
        hi = base + pieces["end"]
        first = np.searchsorted(span_end, lo, side="right")
        per_piece = np.maximum(np.searchsorted(ranges.start, hi, side="left") - first, 0)
        piece_of = np.repeat(np.arange(len(pieces)), per_piece)
        span = np.repeat(first, per_piece) + flat_ranges(per_piece)
        span_lo = np.maximum(ranges.start[span], lo[piece_of])
        self.span_start = span_lo - self.shift[piece_of]
        self.span_len = np.minimum(span_end[span], hi[piece_of]) - span_lo
        span_offsets = np.concatenate([[0], np.cumsum(per_piece)])
        self.span_offsets = span_offsets[self.offsets]

    def gather(self, window: int, row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write one window's tokens into ``row``; return its target spans (row start, length)."""
        p0, p1 = self.offsets[window], self.offsets[window + 1]
        n = self.window_len[window]
        index = np.repeat(self.shift[p0:p1], self.length[p0:p1])
        index += np.arange(n)
        row[:n] = self.tokens[index]
        m0, m1 = self.span_offsets[window], self.span_offsets[window + 1]
        return self.span_start[m0:m1], self.span_len[m0:m1]


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
        self.stream = WindowStream(self.total_windows, seed, rank, world_size)
        self.windows_per_epoch = self.stream.per_epoch
        if self.windows_per_epoch == 0:
            raise ValueError(
                f"rank {rank} of {world_size} gets no window: the shards hold only "
                f"{self.total_windows} windows"
            )
        self.fingerprint = plan_fingerprint(self.shards)
        self.start_batch = 0  # set by SFTLoader.load_state_dict on resume
        self._windows: list[_ShardWindows] | None = None  # built lazily in each process
        self.layout = BatchLayout(micro_batch_size, seq_len + 1)

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

    def resume_batch(self, resume_state: Mapping[int | str, Sequence[int]]) -> int:
        """Validate a loader state ``{worker: last state row}``; the first batch to produce."""
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
            position = self.stream.position(state["epoch"], state["cursor"])
            batch = state["batch"]
            if not batch * self.micro_batch_size < position <= (batch + 1) * self.micro_batch_size:
                raise LoaderStateError(
                    f"resume state row for worker {key} is inconsistent: epoch "
                    f"{state['epoch']} cursor {state['cursor']} after batch {state['batch']}"
                )
            last = max(last, state["batch"])
        return last + 1

    def __iter__(self) -> Iterator[torch.Tensor]:
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
        return self.stream.epoch_windows(epoch)

    def set_stream(self, prefix: np.ndarray, first_epoch: int) -> None:
        """Start with an elastic resume's ``prefix``, then epochs from ``first_epoch``."""
        self.stream = WindowStream(
            self.total_windows, self.seed, self.rank, self.world_size, prefix, first_epoch
        )

    def _batch(self, batch: int) -> torch.Tensor:
        """Batch ``batch`` of this rank, packed into one buffer (see ``BatchLayout``)."""
        size, row_len = self.micro_batch_size, self.seq_len + 1
        positions = np.arange(batch * size, (batch + 1) * size, dtype=np.int64)
        windows = self.stream.windows(positions)
        shard_of = np.searchsorted(self.shard_offsets, windows, side="right") - 1

        packed = torch.empty(self.layout.nbytes, dtype=torch.uint8)
        tokens, mask, trainable_tokens, state = self.layout.views(packed.numpy())
        tokens.fill(self.pad_id)
        starts, lengths = [], []
        assert self._windows is not None
        for row, (shard, window) in enumerate(
            zip(shard_of.tolist(), windows.tolist(), strict=True)
        ):
            span_start, span_len = self._windows[shard].gather(
                window - int(self.shard_offsets[shard]), tokens[row]
            )
            starts.append(span_start + row * row_len)
            lengths.append(span_len)
        span_len = np.concatenate(lengths)
        targets = np.repeat(np.concatenate(starts), span_len) + flat_ranges(span_len)
        mask.fill(False)
        mask.reshape(-1)[targets] = True
        trainable_tokens[:] = mask.sum(axis=1)

        state[:, 0] = self.rank * max(1, self.num_workers) + batch % max(1, self.num_workers)
        state[:, 1], state[:, 2] = self.stream.locate(positions + 1)
        state[:, 3] = batch
        state[:, 4:] = [self.settings()[name] for name in STATE_COLUMNS[4:]]
        return packed


class BatchLayout:
    """One micro-batch as a single byte buffer: int64 tokens, int64 state, int64 target
    counts, then the bool mask (8-byte fields first keeps every view aligned).

    A DataLoader worker hands each tensor to the main process as its own shared-memory
    segment and file descriptor; that costs far more than building the batch, so the
    worker sends one buffer and the main process takes zero-copy views of it.
    """

    def __init__(self, micro_batch_size: int, row_len: int) -> None:
        self.shape = (micro_batch_size, row_len)
        cells = micro_batch_size * row_len
        state_cells = micro_batch_size * len(STATE_COLUMNS)
        self.bounds = np.cumsum([0, cells * 8, state_cells * 8, micro_batch_size * 8, cells])
        self.nbytes = int(self.bounds[-1])

    def views(self, buffer: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, mask, trainable_tokens, state) numpy views of a packed buffer."""
        tokens, state, counts, mask = (
            buffer[lo:hi] for lo, hi in zip(self.bounds[:-1], self.bounds[1:], strict=True)
        )
        return (
            tokens.view(np.int64).reshape(self.shape),
            mask.view(np.bool_).reshape(self.shape),
            counts.view(np.int64),
            state.view(np.int64).reshape(self.shape[0], len(STATE_COLUMNS)),
        )

    def unpack(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch dict, as zero-copy views (pinned if ``packed`` is)."""
        tokens, state, counts, mask = (
            packed[lo:hi]
            for lo, hi in zip(self.bounds[:-1].tolist(), self.bounds[1:].tolist(), strict=True)
        )
        return {
            "tokens": tokens.view(torch.int64).view(self.shape),
            "trainable_mask": mask.view(torch.bool).view(self.shape),
            "trainable_tokens": counts.view(torch.int64),
            "state": state.view(torch.int64).view(self.shape[0], len(STATE_COLUMNS)),
        }


class SFTLoader:
    """Iterable of batch dicts: a DataLoader of packed buffers, unpacked as they arrive.

    Owns the stream's resume state: the last state row per worker of the batches it has
    handed out (``state_dict``), restored before the first iteration (``load_state_dict``).
    """

    def __init__(self, dataloader: DataLoader, dataset: SFTWindowDataset) -> None:
        self.dataloader = dataloader
        self.dataset = dataset
        self._rows: dict[str, list[int]] = {}
        self._started = False

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self._started = True
        packed = iter(self.dataloader)  # starts the workers now, as iter(DataLoader) does
        return (self._track(self.dataset.layout.unpack(p)) for p in packed)

    def _track(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        row = [int(v) for v in batch["state"][-1].tolist()]
        self._rows[str(row[0])] = row
        return batch

    def state_dict(self) -> dict[str, list[int]]:
        """``{global worker id: last state row}`` of the batches handed out so far."""
        return {worker: list(row) for worker, row in self._rows.items()}

    def load_state_dict(self, state: Mapping[int | str, Sequence[int]]) -> None:
        """Continue the stream after ``state`` (from ``state_dict``); before iterating only.

        Raises:
            LoaderStateError: ``state`` belongs to another corpus or loader settings.
        """
        if self._started:
            raise RuntimeError("SFTLoader.load_state_dict must be called before iterating")
        self.dataset.start_batch = self.dataset.resume_batch(state)
        self._rows = {str(k): [int(v) for v in row] for k, row in state.items()}

    def stream_state_dict(self) -> dict[str, torch.Tensor | int]:
        """The stream's shape, the same on every rank: an elastic prefix (may be empty) and
        the epoch after it."""
        stream = self.dataset.stream
        return {"prefix": torch.from_numpy(stream.prefix.copy()), "first_epoch": stream.first_epoch}

    def load_stream_state_dict(self, state: Mapping[str, torch.Tensor | int]) -> None:
        """Restore ``stream_state_dict`` (before ``load_state_dict``)."""
        if self._started:
            raise RuntimeError("SFTLoader.load_stream_state_dict must be called before iterating")
        prefix = torch.as_tensor(state["prefix"]).numpy().astype(np.int64)
        self.dataset.set_stream(prefix, int(state["first_epoch"]))

    def load_elastic_state_dict(
        self,
        ranks: Sequence[Mapping[int | str, Sequence[int]]],
        stream: Mapping[str, torch.Tensor | int],
    ) -> None:
        """Continue a stream saved by another topology: ``ranks[r]`` is old rank ``r``'s
        ``state_dict``, ``stream`` its ``stream_state_dict``.

        The windows no old rank consumed are re-dealt over this loader's ranks as the prefix
        of a fresh stream (every rank computes the same), then epochs continue.

        Raises:
            LoaderStateError: the old stream used another corpus plan, seq_len or seed.
        """
        if self._started:
            raise RuntimeError("SFTLoader.load_elastic_state_dict must be called before iterating")
        dataset, consumed = self.dataset, []
        expected = dataset.settings()
        for rank, rows in enumerate(ranks):
            states = [
                dict(zip(STATE_COLUMNS, (int(v) for v in row), strict=True))
                for row in rows.values()
            ]
            if not states:
                raise LoaderStateError(f"resume state of old rank {rank} holds no consumed batch")
            for name in ("seq_len", "seed", "fingerprint"):
                if any(st[name] != expected[name] for st in states):
                    raise LoaderStateError(
                        f"elastic resume refused: the state was saved with {_WHAT[name]}="
                        f"{states[0][name]}, this loader has {expected[name]}"
                    )
            if any(st["world_size"] != len(ranks) for st in states):
                raise LoaderStateError(
                    f"resume state of old rank {rank} names world_size {states[0]['world_size']}, "
                    f"but {len(ranks)} ranks were saved"
                )
            last = max(states, key=lambda st: st["batch"])
            consumed.append((last["batch"] + 1) * last["micro_batch_size"])
        old = WindowStream(dataset.total_windows, dataset.seed, 0, len(ranks))
        saved_prefix = torch.as_tensor(stream["prefix"]).numpy().astype(np.int64)
        streams = [
            WindowStream(
                old.total_windows, old.seed, r, len(ranks), saved_prefix, int(stream["first_epoch"])
            )
            for r in range(len(ranks))
        ]
        prefix, first_epoch = remaining_windows(streams, consumed)
        dataset.set_stream(prefix, first_epoch)
        dataset.start_batch = 0
        self._rows = {}

    def matches(self, rows: Mapping[int | str, Sequence[int]], saved_world_size: int) -> bool:
        """True when ``rows`` (this rank's saved state) came from this loader's topology:
        the same world size, worker count and micro-batch size."""
        if saved_world_size != self.dataset.world_size or not rows:
            return False
        expected = self.dataset.settings()
        names = ("world_size", "num_workers", "micro_batch_size")
        return all(
            int(row[STATE_COLUMNS.index(name)]) == expected[name]
            for row in rows.values()
            for name in names
        )

    def trained_windows(self, batch: Mapping[str, torch.Tensor]) -> np.ndarray:
        """Global window id of each row of a batch this loader produced (for audits)."""
        state = batch["state"].numpy()
        stream = self.dataset.stream
        after = [stream.position(int(e), int(c)) for e, c in state[:, 1:3]]
        return stream.windows(np.asarray(after, np.int64) - 1)


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
) -> tuple[SFTLoader, SFTWindowDataset]:
    """An endless iterable of this rank's micro-batches, and the dataset behind it.

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
        resume_state: an earlier loader's ``state_dict()`` (same as ``load_state_dict``).
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
    )
    workers = {}
    if num_workers > 0:
        workers = {
            "prefetch_factor": prefetch_factor,
            "persistent_workers": persistent_workers,
            "worker_init_fn": StopSignalGuard(),
            "multiprocessing_context": worker_start_method(),
        }
    dataloader = DataLoader(
        dataset,
        batch_size=None,  # the dataset yields whole micro-batches
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        **workers,
    )
    loader = SFTLoader(dataloader, dataset)
    if resume_state:
        loader.load_state_dict(resume_state)
    return loader, dataset
