"""What one training window holds, for humans and audit tools (``nedolm-sft inspect``).

Windows are numbered globally, shards in id order, as the loader numbers them. A window is
described piece by piece, each piece as runs of tokens that share a message, a part of that
message (header, content, end token, EOS) and a target flag, so a renderer can mark message
boundaries and highlight targets without looking at single tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np

from nedolm.data.format import read_special_tokens
from nedolm.data.packing import PlannedShard
from nedolm.data.records import ROLE_NAMES

PARTS = ("header", "content", "end", "eos")


class InspectError(ValueError):
    """A window or document number outside the corpus."""


@dataclass(frozen=True)
class Run:
    """Consecutive tokens of one message part with the same target flag."""

    part: str  # one of PARTS
    role: str  # role name of the message; "" for EOS
    message_start: bool  # the run begins at its message's first token
    token_ids: list[int]
    target: bool


@dataclass(frozen=True)
class PieceView:
    shard_id: int
    doc: int  # row in the shard's index
    doc_key: int
    start: int
    end: int
    target_from: int
    runs: list[Run]


@dataclass(frozen=True)
class WindowView:
    window: int  # global window number
    shard_id: int
    local_window: int
    row_len: int  # seq_len + 1
    pieces: list[PieceView]

    @property
    def tokens(self) -> int:
        return sum(p.end - p.start for p in self.pieces)

    @property
    def targets(self) -> int:
        return sum(len(r.token_ids) for p in self.pieces for r in p.runs if r.target)


def locate_window(shards: Sequence[PlannedShard], window: int) -> tuple[int, int]:
    """(index into ``shards``, window number inside that shard) of a global window number."""
    offsets = np.cumsum([0, *(s.plan.counts.windows for s in shards)])
    if not 0 <= window < offsets[-1]:
        raise InspectError(f"window {window} does not exist: the plan has {offsets[-1]} windows")
    shard = int(np.searchsorted(offsets, window, side="right") - 1)
    return shard, window - int(offsets[shard])


def window_view(shards: Sequence[PlannedShard], window: int) -> WindowView:
    """Every piece of global window ``window``, as runs of message parts."""
    shard_index, local = locate_window(shards, window)
    planned = shards[shard_index]
    offsets = planned.plan.window_offsets
    rows = planned.plan.pieces[int(offsets[local]) : int(offsets[local + 1])]
    return WindowView(
        window=window,
        shard_id=planned.shard_id,
        local_window=local,
        row_len=planned.seq_len + 1,
        pieces=[_piece_view(planned, row) for row in rows],
    )


def document_windows(shards: Sequence[PlannedShard], doc: int) -> list[int]:
    """Global numbers of the windows holding a piece of global document ``doc``."""
    window_base = doc_base = 0
    for s in shards:
        documents = len(s.shard.index)
        if doc < doc_base + documents:
            pieces = s.plan.pieces
            return sorted(
                {window_base + int(w) for w in pieces["window"][pieces["doc"] == doc - doc_base]}
            )
        window_base += s.plan.counts.windows
        doc_base += documents
    raise InspectError(f"document {doc} does not exist: the corpus has {doc_base} documents")


def iter_plan_rows(shards: Sequence[PlannedShard]) -> Iterator[dict]:
    """One JSON-ready record per window, in global order: its shard and pieces."""
    window_base = 0
    for s in shards:
        pieces, offsets = s.plan.pieces, s.plan.window_offsets.tolist()
        keys = s.shard.index["doc_key"]
        for local in range(s.plan.counts.windows):
            rows = pieces[offsets[local] : offsets[local + 1]]
            yield {
                "window": window_base + local,
                "shard": s.shard_id,
                "pieces": [
                    {
                        "doc": int(p["doc"]),
                        "doc_key": int(keys[p["doc"]]),
                        "start": int(p["start"]),
                        "end": int(p["end"]),
                        "target_from": int(p["target_from"]),
                    }
                    for p in rows
                ],
            }
        window_base += s.plan.counts.windows


def corpus_decoder(data_dir: Path) -> Callable[[list[int]], str] | None:
    """Decoding function of the tokenizer copy the corpus records, or None if it has none."""
    from nedolm.data.tokenizer import load_tokenizer

    info = read_special_tokens(data_dir).tokenizer
    path = Path(data_dir) / info.file
    if not info.file or not path.is_file():
        return None
    return load_tokenizer(path).decode


def _piece_view(planned: PlannedShard, piece: np.void) -> PieceView:
    index, segments = planned.shard.index, planned.shard.segments
    doc = int(piece["doc"])
    first = int(index["segment_start"][doc])
    messages = segments[first : first + int(index["segment_count"][doc])]
    start, end = int(piece["start"]), int(piece["end"])
    positions = np.arange(start, end)
    # Message of each position (-1: the final EOS) and the part of the message it is in.
    message = np.searchsorted(messages["start"].astype(np.int64), positions, side="right") - 1
    message_end = (messages["start"] + messages["length"]).astype(np.int64)
    message[positions >= message_end[message]] = -1
    offset = positions - messages["start"][message].astype(np.int64)
    header = messages["header_len"][message].astype(np.int64)
    length = messages["length"][message].astype(np.int64)
    part = np.where(offset < header, 0, np.where(offset < length - 1, 1, 2))
    part[message < 0] = 3
    target = (
        (message >= 0)
        & (messages["trainable"][message] != 0)
        & (offset >= header)
        & (positions >= int(piece["target_from"]))
    )
    token_start = int(index["token_start"][doc])
    ids = planned.shard.tokens[token_start + start : token_start + end].tolist()
    change = np.flatnonzero(
        (np.diff(message) != 0) | (np.diff(part) != 0) | (np.diff(target.astype(np.int8)) != 0)
    )
    bounds = [0, *(change + 1).tolist(), len(positions)]
    runs = [
        Run(
            part=PARTS[part[lo]],
            role=ROLE_NAMES[messages["role"][message[lo]]] if message[lo] >= 0 else "",
            message_start=bool(message[lo] >= 0 and offset[lo] == 0),
            token_ids=ids[lo:hi],
            target=bool(target[lo]),
        )
        for lo, hi in pairwise(bounds)
    ]
    return PieceView(
        shard_id=planned.shard_id,
        doc=doc,
        doc_key=int(index["doc_key"][doc]),
        start=start,
        end=end,
        target_from=int(piece["target_from"]),
        runs=runs,
    )
