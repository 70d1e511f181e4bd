"""The adaptive packing planner (SPEC §3, ``adaptive_document_turn_overlap_v2``).

A plan is a pure, deterministic function of one shard's index and segment records and
``seq_len``. Training rows are windows of ``seq_len + 1`` tokens. A document that fits is a
single piece; a longer one becomes a chain of pieces whose continuations start at message
boundaries and mask the targets an earlier piece already trained. Pieces are then bin-packed
into windows with best-fit decreasing, so whole documents are never split and every target
is trained exactly once.

Speed matters: the trainer recomputes the plan at every start, on millions of documents. The
common case (a document that fits) is handled in bulk with numpy, all chains advance together
one piece per step, and best-fit decreasing runs on size classes (every item of one size
behaves the same), so Python work grows with the number of distinct sizes and the length of the
longest chain, not with the number of documents.

Tie-breaking, which fixes the plan exactly: items are placed largest first, equal sizes in
(document, piece) order; an item goes to the open window with the least free space that still
holds it, and among windows with equal free space to the one that reached that free space
first; otherwise a new window opens. Windows are numbered in opening order and a window's
pieces are listed in placement order.
"""

from __future__ import annotations

import itertools
import zlib
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from nedolm.data.format import Shard, discover_shards
from nedolm.data.records import ROLE_ASSISTANT

PIECE_DTYPE = np.dtype(
    [
        ("window", "<u8"),  # window number, 0..n-1; a window is the rows sharing it, in row order
        ("doc", "<u4"),  # row of the document in the shard's index
        ("start", "<u4"),  # document-relative first token of the piece
        ("end", "<u4"),  # document-relative end (exclusive)
        ("target_from", "<u4"),  # targets at document positions < target_from are masked
    ]
)
"""One row per piece of a window; a window's pieces concatenated fill at most seq_len + 1."""

DROP_NO_TARGET = "no_target"
DROP_MESSAGE_TOO_LONG = "message_too_long"
DROP_HARD_CONTINUATION = "hard_continuation"


class PackingError(ValueError):
    """Index and segment records that do not describe a valid shard layout."""


class PackingCounts(msgspec.Struct, frozen=True, kw_only=True):
    """Plan totals; additive over shards (``a + b``), written to the packing audit."""

    documents: int = 0
    windows: int = 0
    raw_tokens: int = 0  # every document token, EOS included, planned or not
    valid_context_tokens: int = 0  # tokens placed in windows (overlaps counted again)
    padded_tokens: int = 0  # windows * (seq_len + 1) - valid_context_tokens
    assistant_target_tokens: int = 0  # targets trained by the plan (each exactly once)
    turn_aligned_continuations: int = 0
    assistant_aligned_continuations: int = 0
    hard_continuations: int = 0

    def __add__(self, other: PackingCounts) -> PackingCounts:
        return PackingCounts(
            **{f: getattr(self, f) + getattr(other, f) for f in self.__struct_fields__}
        )


@dataclass(frozen=True)
class ShardPlan:
    """One shard's windows as pieces (PIECE_DTYPE rows, sorted by window) and its totals."""

    pieces: np.ndarray
    counts: PackingCounts

    @property
    def window_offsets(self) -> np.ndarray:
        """``pieces[offsets[w]:offsets[w + 1]]`` are window ``w``'s pieces (CSR layout)."""
        return np.searchsorted(
            self.pieces["window"], np.arange(self.counts.windows + 1, dtype=np.uint64)
        )


def plan_shard(index: np.ndarray, segments: np.ndarray, seq_len: int) -> ShardPlan:
    """Plan one shard's windows of ``seq_len + 1`` tokens.

    Args:
        index: INDEX_DTYPE records, one per document.
        segments: SEGMENT_DTYPE records, one per message, documents in index order.
        seq_len: model context; windows hold ``seq_len + 1`` tokens.

    Raises:
        PackingError: the records are inconsistent (segments not contiguous per document,
            a message outside its document).
    """
    window = _window_len(seq_len)
    seg_doc = _segment_documents(index, segments)
    token_len = index["token_len"].astype(np.int64)
    targets = _target_ranges(index, segments, seg_doc)
    doc_targets = np.bincount(targets.doc, weights=targets.length, minlength=len(index))
    has_target = doc_targets > 0

    whole = np.flatnonzero(has_target & (token_len <= window))
    long_docs = np.flatnonzero(has_target & (token_len > window))
    chains = _plan_chains(long_docs, index, segments, window)

    zeros = np.zeros(len(whole), np.int64)
    docs = np.concatenate([whole, chains.doc])
    starts = np.concatenate([zeros, chains.start])
    ends = np.concatenate([token_len[whole], chains.end])
    target_from = np.concatenate([zeros, chains.target_from])
    sizes = ends - starts

    # Placement order: larger first, then document order, then chain order. Whole documents
    # and chains each come in (document, chain) order, so merging them gives that order, and
    # one stable sort on a 16-bit size key (numpy radix-sorts it) does the rest.
    chain_slot = np.searchsorted(whole, chains.doc) + np.arange(len(chains.doc))
    whole_slot = np.ones(len(docs), bool)
    whole_slot[chain_slot] = False
    by_doc = np.empty(len(docs), np.int64)
    by_doc[chain_slot] = np.arange(len(whole), len(docs))
    by_doc[whole_slot] = np.arange(len(whole))
    free = (window - sizes[by_doc]).astype(np.uint16 if window <= 1 << 16 else np.int64)
    order = by_doc[np.argsort(free, kind="stable")]
    window_of_placed, n_windows = _best_fit_decreasing(sizes[order], window)
    by_window = np.argsort(window_of_placed, kind="stable")  # then in placement order
    rows = order[by_window]

    pieces = np.empty(len(rows), PIECE_DTYPE)
    pieces["window"] = window_of_placed[by_window]
    pieces["doc"] = docs[rows]
    pieces["start"] = starts[rows]
    pieces["end"] = ends[rows]
    pieces["target_from"] = target_from[rows]

    valid = int(sizes.sum())
    # A whole document trains all its targets; only chain pieces need counting.
    in_chain = rows >= len(whole)  # rows index [whole documents, chain pieces]
    trained = int(doc_targets[whole].sum()) + int(
        piece_target_counts(pieces[in_chain], index, targets).sum()
    )
    counts = PackingCounts(
        documents=len(index),
        windows=n_windows,
        raw_tokens=int(token_len.sum()),
        valid_context_tokens=valid,
        padded_tokens=n_windows * window - valid,
        assistant_target_tokens=trained,
        turn_aligned_continuations=chains.turn_aligned,
        assistant_aligned_continuations=chains.assistant_aligned,
        hard_continuations=chains.hard,
    )
    return ShardPlan(pieces=pieces, counts=counts)


@dataclass(frozen=True)
class PlannedShard:
    """A stored shard with its plan at one ``seq_len``: what the stats and the loader consume."""

    shard: Shard
    seq_len: int
    plan: ShardPlan

    @property
    def shard_id(self) -> int:
        return self.shard.shard_id

    @property
    def token_path(self) -> Path:
        return self.shard.token_path


def plan_stored_shard(shard: Shard, seq_len: int) -> PlannedShard:
    """Plan one stored shard; a planning error names the shard's index file."""
    try:
        plan = plan_shard(shard.index, shard.segments, seq_len)
    except PackingError as exc:
        raise PackingError(f"{shard.index_path}: {exc}") from exc
    return PlannedShard(shard=shard, seq_len=seq_len, plan=plan)


def discover_sft_shards(data_dir: Path, seq_len: int) -> list[PlannedShard]:
    """Every shard of ``data_dir`` (sorted by id) with its plan, recomputed from the records.

    Raises:
        ShardFormatError: a missing, truncated or foreign shard file (names the file).
        PackingError: records the planner cannot use (names the index file).
    """
    return [plan_stored_shard(shard, seq_len) for shard in discover_shards(data_dir)]


def plan_fingerprint(shards: Sequence[PlannedShard]) -> int:
    """32-bit CRC of the shard ids, seq_len and every piece: equal iff the plans are equal."""
    crc = 0
    for s in shards:
        crc = zlib.crc32(np.array([s.shard_id, s.seq_len], "<i8").tobytes(), crc)
        crc = zlib.crc32(np.ascontiguousarray(s.plan.pieces).tobytes(), crc)
    return crc


def document_drop_reason(segments: np.ndarray, seq_len: int) -> str | None:
    """Why the builder must drop a document (its SEGMENT_DTYPE records), or None to keep it.

    ``no_target``: no trainable token. ``hard_continuation``: a trainable message longer than
    a window, so some of its targets could only be reached by a window starting inside it
    (the only way the continuation rule can fail; the property tests check this against the
    reference planner). ``message_too_long``: a context message longer than a window, which
    no window could ever show whole.
    """
    window = _window_len(seq_len)
    lengths = segments["length"].astype(np.int64)
    trainable = (segments["trainable"] != 0) & (lengths > segments["header_len"])
    if not trainable.any():
        return DROP_NO_TARGET
    if (lengths[trainable] > window).any():
        return DROP_HARD_CONTINUATION
    if (lengths > window).any():
        return DROP_MESSAGE_TOO_LONG
    return None


@dataclass(frozen=True)
class TargetRanges:
    """Every trainable message's target span, in shard-token coordinates, sorted."""

    doc: np.ndarray  # document row of each span
    start: np.ndarray  # shard-token position of the span's first target
    length: np.ndarray
    before: np.ndarray  # targets in all earlier spans (exclusive prefix sum)


def target_ranges(index: np.ndarray, segments: np.ndarray) -> TargetRanges:
    """Target spans ``[start + header_len, start + length)`` of trainable messages, shard-wide."""
    return _target_ranges(index, segments, _segment_documents(index, segments))


def targets_before(ranges: TargetRanges, positions: np.ndarray) -> np.ndarray:
    """How many target positions of the shard lie strictly before each shard-token position."""
    positions = np.asarray(positions, dtype=np.int64)
    if not len(ranges.start):
        return np.zeros_like(positions)
    span = np.searchsorted(ranges.start, positions, side="right") - 1
    clipped = np.maximum(span, 0)
    inside = np.clip(positions - ranges.start[clipped], 0, ranges.length[clipped])
    return np.where(span >= 0, ranges.before[clipped] + inside, 0)


def piece_target_counts(pieces: np.ndarray, index: np.ndarray, ranges: TargetRanges) -> np.ndarray:
    """Targets each piece trains: target positions in ``[max(start, target_from), end)``."""
    base = index["token_start"].astype(np.int64)[pieces["doc"]]
    first = base + np.maximum(pieces["start"], pieces["target_from"]).astype(np.int64)
    end = base + pieces["end"].astype(np.int64)
    return targets_before(ranges, end) - targets_before(ranges, np.minimum(first, end))


def _target_ranges(index: np.ndarray, segments: np.ndarray, seg_doc: np.ndarray) -> TargetRanges:
    length = segments["length"].astype(np.int64) - segments["header_len"]
    keep = np.flatnonzero((segments["trainable"] != 0) & (length > 0))
    doc = seg_doc[keep]
    start = (
        index["token_start"].astype(np.int64)[doc]
        + segments["start"][keep]
        + segments["header_len"][keep]
    )
    length = length[keep]
    before = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64)
    return TargetRanges(doc=doc, start=start, length=length, before=before)


def flat_ranges(lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(n) for n in lengths])`` without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(lengths) - lengths, lengths
    )


def _window_len(seq_len: int) -> int:
    if seq_len < 1:
        raise PackingError(f"seq_len must be positive, got {seq_len}")
    return seq_len + 1


def _segment_documents(index: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """Document row of every segment; checks that documents own contiguous segment runs."""
    count = index["segment_count"].astype(np.int64)
    expected_start = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    bad = np.flatnonzero(index["segment_start"].astype(np.int64) != expected_start)
    if len(bad):
        raise PackingError(
            f"document {bad[0]}: segment_start {index['segment_start'][bad[0]]} "
            f"!= {expected_start[bad[0]]} (segments must be contiguous in document order)"
        )
    if int(count.sum()) != len(segments):
        raise PackingError(f"index counts {int(count.sum())} segments, found {len(segments)}")
    seg_doc = np.repeat(np.arange(len(index), dtype=np.int64), count)
    seg_end = segments["start"].astype(np.int64) + segments["length"]
    outside = np.flatnonzero(seg_end > index["token_len"].astype(np.int64)[seg_doc])
    if len(outside):
        raise PackingError(
            f"segment {outside[0]} of document {seg_doc[outside[0]]} ends at {seg_end[outside[0]]}, "
            f"past the document's {index['token_len'][seg_doc[outside[0]]]} tokens"
        )
    return seg_doc


@dataclass
class _Chains:
    """Pieces of all long documents in (document, chain) order, and continuation counts."""

    doc: np.ndarray
    start: np.ndarray
    end: np.ndarray
    target_from: np.ndarray
    turn_aligned: int
    assistant_aligned: int
    hard: int


def _plan_chains(docs: np.ndarray, index: np.ndarray, segments: np.ndarray, window: int) -> _Chains:
    """Split every document in ``docs`` (all longer than a window) into a chain (FORMAT.md).

    All chains advance together, one piece per step, so the Python loop runs as many times as
    the longest chain has pieces; the arrays hold only these documents' messages. Positions
    are shard-token positions until the end.
    """
    counts = index["segment_count"].astype(np.int64)[docs]
    rows = np.repeat(index["segment_start"].astype(np.int64)[docs], counts) + flat_ranges(counts)
    owner = np.repeat(np.arange(len(docs)), counts)  # position in ``docs`` of each message
    messages = segments[rows]
    doc_start = index["token_start"].astype(np.int64)[docs]
    msg_start = doc_start[owner] + messages["start"]
    # Shard position of the latest user/system message start at or before each message.
    context = np.where(messages["role"] != ROLE_ASSISTANT, np.arange(len(rows)), -1)
    context = np.maximum.accumulate(context) if len(context) else context
    same_doc = (context >= 0) & (owner[np.maximum(context, 0)] == owner)
    latest_context = np.where(same_doc, msg_start[np.maximum(context, 0)], -1)
    spans = np.flatnonzero(
        (messages["trainable"] != 0) & (messages["length"] > messages["header_len"])
    )
    span_start = msg_start[spans] + messages["header_len"][spans]
    span_end = msg_start[spans] + messages["length"][spans]

    first_pos = doc_start
    last_pos = first_pos + index["token_len"].astype(np.int64)[docs]
    covered = first_pos.copy()  # every target before it is trained
    pieces, continuations = [], np.zeros(3, np.int64)
    active = np.arange(len(docs))
    for rank in itertools.count():
        span = np.searchsorted(span_end, covered[active], side="right")
        # The first untrained target must exist and belong to the same document.
        alive = span < len(span_end)
        alive[alive] = owner[spans[span[alive]]] == active[alive]
        active, span = active[alive], span[alive]
        if not len(active):
            break
        target = np.maximum(span_start[span], covered[active])
        message = spans[span]
        context_start = latest_context[message]
        first = (covered[active] == first_pos[active]) & (target - first_pos[active] < window)
        turn = ~first & (context_start >= 0) & (target - context_start < window)
        assistant = ~first & ~turn & (target - msg_start[message] < window)
        hard = ~first & ~turn & ~assistant  # would start inside the message: start at t - 1
        start = np.select(
            [first, turn, assistant], [first_pos[active], context_start, msg_start[message]],
            target - 1,
        )  # fmt: skip
        end = np.minimum(start + window, last_pos[active])
        base = first_pos[active]
        target_from = np.where(first, 0, target - base)
        pieces.append(
            (docs[active], start - base, end - base, target_from, np.full_like(end, rank))
        )
        continuations += [turn.sum(), assistant.sum(), hard.sum()]
        covered[active] = end
        active = active[end < last_pos[active]]
    if not pieces:
        return _Chains(*[np.zeros(0, np.int64)] * 4, 0, 0, 0)
    doc, start, end, target_from, rank = (np.concatenate(c) for c in zip(*pieces, strict=True))
    chain_order = np.lexsort((rank, doc))
    return _Chains(
        *(a[chain_order] for a in (doc, start, end, target_from)),
        *(int(c) for c in continuations),
    )


def _best_fit_decreasing(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Best-fit decreasing on non-increasing ``sizes`` in ``[1, capacity]``; bin per item.

    Works per size class. Scanning free capacities upward from the item size ``x``, the first
    non-empty free capacity ``c`` is the best fit; a bin there keeps being the best fit until
    it has taken ``c // x`` items (every free capacity in ``[x, c)`` is empty), so each bin of
    a bucket takes ``c // x`` items in FIFO order. New bins are a bottomless bucket at
    ``capacity``, reached only when no open bin fits.
    """
    bin_of = np.empty(len(sizes), np.int64)
    buckets: dict[int, _Bucket] = {}
    open_free: list[int] = []  # sorted free capacities whose bucket is non-empty
    n_bins, pos = 0, 0

    def put(free: int, ids: np.ndarray) -> None:
        if free == 0 or not len(ids):
            return
        if free not in buckets:
            buckets[free] = _Bucket()
            insort(open_free, free)
        buckets[free].push(ids)

    class_ends = np.append(np.flatnonzero(np.diff(sizes)) + 1, len(sizes))
    for end in class_ends[class_ends > 0].tolist():
        size = int(sizes[pos])
        while pos < end:
            remaining = end - pos
            i = bisect_left(open_free, size)
            if i < len(open_free):
                free = open_free[i]
                bucket = buckets[free]
                per_bin = free // size
                full = bucket.take(min(remaining // per_bin, bucket.size))
            else:
                free = capacity
                bucket = None
                per_bin = free // size
                full = np.arange(n_bins, n_bins + remaining // per_bin)
                n_bins += len(full)
            bin_of[pos : pos + len(full) * per_bin] = np.repeat(full, per_bin)
            pos += len(full) * per_bin
            put(free - per_bin * size, full)
            remaining = end - pos
            if 0 < remaining < per_bin and (bucket is None or bucket.size):
                if bucket is None:
                    partial = np.array([n_bins])
                    n_bins += 1
                else:
                    partial = bucket.take(1)
                bin_of[pos:end] = partial[0]
                pos = end
                put(free - remaining * size, partial)
            if bucket is not None and not bucket.size:
                del buckets[free]
                del open_free[bisect_left(open_free, free)]
    return bin_of, n_bins


class _Bucket:
    """FIFO of bin ids stored as numpy chunks, so bulk moves cost O(chunks), not O(bins)."""

    def __init__(self) -> None:
        self.chunks: deque[np.ndarray] = deque()
        self.size = 0

    def push(self, ids: np.ndarray) -> None:
        self.chunks.append(ids)
        self.size += len(ids)

    def take(self, count: int) -> np.ndarray:
        taken = []
        need = count
        while need:
            head = self.chunks[0]
            if len(head) <= need:
                taken.append(self.chunks.popleft())
                need -= len(head)
            else:
                taken.append(head[:need])
                self.chunks[0] = head[need:]
                need = 0
        self.size -= count
        return np.concatenate(taken) if taken else np.empty(0, np.int64)
