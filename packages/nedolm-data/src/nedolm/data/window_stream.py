"""The order in which the ranks train a corpus's windows, epoch after epoch.

A pure function of (total windows, seed, rank, world size), plus an elastic resume's prefix:

* every epoch ``e`` shuffles all windows with ``np.random.default_rng([seed, e]).permutation``;
  rank ``r`` takes ``perm[r::world_size]``;
* after an elastic resume (another world size, micro-batch or worker count) the stream starts
  with a *prefix*: the windows of the interrupted epoch that no old rank consumed, dealt
  ``prefix[r::world_size]``; epochs then continue from the next one (``remaining_windows``).

Numpy only: the loader (``nedolm.data.loader``) turns positions into batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def epoch_permutation(seed: int, epoch: int, total_windows: int) -> np.ndarray:
    """The global window order of ``epoch``: a pure function of the seed."""
    return np.random.default_rng([seed, epoch]).permutation(total_windows)


class WindowStream:
    """Which global window one rank trains at each position of its endless stream.

    The stream is ``prefix[rank::world_size]`` (empty unless resumed elastically), then
    epochs ``first_epoch, first_epoch + 1, ...``, each ``perm(e)[rank::world_size]``.
    Positions in the prefix carry the epoch label ``first_epoch - 1`` (the epoch they finish)
    and their index in this rank's share of the prefix as cursor.
    """

    def __init__(
        self,
        total_windows: int,
        seed: int,
        rank: int,
        world_size: int,
        prefix: np.ndarray | None = None,
        first_epoch: int = 0,
    ) -> None:
        self.total_windows, self.seed = total_windows, seed
        self.rank, self.world_size = rank, world_size
        self.prefix = np.zeros(0, np.int64) if prefix is None else np.asarray(prefix, np.int64)
        self.first_epoch = first_epoch
        self.share = self.prefix[rank::world_size]
        self.per_epoch = len(range(rank, total_windows, world_size))
        self._epochs: dict[int, np.ndarray] = {}

    def epoch_windows(self, epoch: int) -> np.ndarray:
        """Global window ids this rank trains in ``epoch``, in order (cached: two epochs)."""
        if epoch not in self._epochs:
            perm = epoch_permutation(self.seed, epoch, self.total_windows)
            self._epochs = {e: w for e, w in self._epochs.items() if e == epoch - 1}
            self._epochs[epoch] = perm[self.rank :: self.world_size]
        return self._epochs[epoch]

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(epoch label, cursor) of each stream position."""
        after = positions - len(self.share)
        in_prefix = after < 0
        epochs = np.where(
            in_prefix, self.first_epoch - 1, self.first_epoch + after // self.per_epoch
        )
        return epochs, np.where(in_prefix, positions, after % self.per_epoch)

    def position(self, epoch: int, cursor: int) -> int:
        """The stream position ``locate`` maps to (``epoch``, ``cursor``)."""
        if epoch < self.first_epoch:
            return cursor
        return len(self.share) + (epoch - self.first_epoch) * self.per_epoch + cursor

    def windows(self, positions: np.ndarray) -> np.ndarray:
        """Global window id at each stream position."""
        epochs, cursors = self.locate(positions)
        windows = np.empty(len(positions), np.int64)
        in_prefix = epochs < self.first_epoch
        windows[in_prefix] = self.share[cursors[in_prefix]]
        for epoch in np.unique(epochs[~in_prefix]).tolist():
            rows = epochs == epoch
            windows[rows] = self.epoch_windows(epoch)[cursors[rows]]
        return windows


def remaining_windows(
    streams: Sequence[WindowStream], consumed: Sequence[int]
) -> tuple[np.ndarray, int]:
    """What an elastic resume re-deals: (windows no rank consumed, first epoch after them).

    ``streams[r]`` is old rank ``r``'s stream and ``consumed[r]`` how many of its positions
    were trained. Every segment some rank has entered (the prefix, then each epoch up to the
    furthest rank's) contributes its unconsumed windows in segment order, so each window is
    still trained exactly once per epoch.
    """
    head, world_size = streams[0], len(streams)
    pairs = list(zip(streams, consumed, strict=True))
    last = max(int(s.locate(np.array([n]))[0][0]) for s, n in pairs)
    segments = [(head.prefix, [min(n, len(s.share)) for s, n in pairs])]
    for epoch in range(head.first_epoch, last + 1):
        skip = epoch - head.first_epoch
        counts = [
            int(np.clip(n - len(s.share) - skip * s.per_epoch, 0, s.per_epoch)) for s, n in pairs
        ]
        segments.append((epoch_permutation(head.seed, epoch, head.total_windows), counts))
    pieces = []
    for windows, counts in segments:
        taken = np.zeros(len(windows), bool)
        for rank, count in enumerate(counts):
            taken[np.arange(rank, len(windows), world_size)[:count]] = True
        pieces.append(windows[~taken])
    return np.concatenate(pieces).astype(np.int64), max(head.first_epoch, last + 1)
