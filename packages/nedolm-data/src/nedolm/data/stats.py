"""Corpus statistics: the totals the trainer logs and checks, and the packing quality report
of ``nedolm-sft stats`` (adaptive packing against two common baselines).

Ratios are over row tokens: a window is one row of ``seq_len + 1`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nedolm.data.packing import (
    PackingCounts,
    PlannedShard,
    piece_target_counts,
    target_ranges,
    targets_before,
)


def corpus_stats(shards: Sequence[PlannedShard], seq_len: int) -> dict[str, int | float]:
    """Plan totals over ``shards`` with the keys the trainer reads (and checks against the audit).

    ``valid_context_ratio`` and ``assistant_target_ratio`` are fractions of all row tokens
    (``windows * (seq_len + 1)``).

    Raises:
        ValueError: a shard was planned for another ``seq_len``.
    """
    total = PackingCounts()
    for s in shards:
        if s.seq_len != seq_len:
            raise ValueError(f"{s.token_path}: planned for seq_len {s.seq_len}, not {seq_len}")
        total = total + s.plan.counts
    row_tokens = max(1, total.windows * (seq_len + 1))
    return {
        "shards": len(shards),
        "documents": total.documents,
        "raw_tokens": total.raw_tokens,
        "windows": total.windows,
        "valid_context_tokens": total.valid_context_tokens,
        "padded_tokens": total.padded_tokens,
        "valid_context_ratio": total.valid_context_tokens / row_tokens,
        "assistant_target_tokens": total.assistant_target_tokens,
        "assistant_target_ratio": total.assistant_target_tokens / row_tokens,
        "turn_aligned_continuations": total.turn_aligned_continuations,
        "assistant_aligned_continuations": total.assistant_aligned_continuations,
        "hard_continuations": total.hard_continuations,
    }


def packing_quality(shards: Sequence[PlannedShard], seq_len: int) -> dict[str, dict[str, float]]:
    """Adaptive packing against two baselines on the same documents, per row of seq_len + 1.

    ``truncate``: one conversation per row, cut to ``seq_len + 1`` tokens (peer trainers'
    default); targets past the cut are lost. ``concat_chunk``: all documents of a shard
    concatenated and cut into rows every ``seq_len`` tokens without attention isolation; no
    target is lost, but ``cross_document_targets`` attend to another conversation and
    ``split_documents`` lose their beginning. ``targets_lost`` of the adaptive plan is
    recounted from its pieces, not taken from its counts.
    """
    row = seq_len + 1
    totals = {name: dict.fromkeys(_QUALITY_KEYS, 0) for name in ("adaptive", "truncate")}
    totals["concat_chunk"] = dict.fromkeys(
        (*_QUALITY_KEYS, "cross_document_targets", "split_documents"), 0
    )
    totals["adaptive"] |= {"continuations": 0, "hard_continuations": 0}
    for s in shards:
        if s.seq_len != seq_len:
            raise ValueError(f"{s.token_path}: planned for seq_len {s.seq_len}, not {seq_len}")
        index = s.shard.index
        ranges = target_ranges(index, s.shard.segments)
        all_targets = int(ranges.length.sum())
        doc_start = index["token_start"].astype(np.int64)
        doc_len = index["token_len"].astype(np.int64)

        counts = s.plan.counts
        trained = int(piece_target_counts(s.plan.pieces, index, ranges).sum())
        _add(totals["adaptive"], counts.windows, counts.valid_context_tokens, row, all_targets)
        totals["adaptive"]["targets_lost"] += all_targets - trained
        totals["adaptive"]["continuations"] += (
            counts.turn_aligned_continuations + counts.assistant_aligned_continuations
        )
        totals["adaptive"]["hard_continuations"] += counts.hard_continuations

        kept = targets_before(ranges, doc_start + np.minimum(doc_len, row)) - targets_before(
            ranges, doc_start
        )
        _add(totals["truncate"], len(index), int(np.minimum(doc_len, row).sum()), row, all_targets)
        totals["truncate"]["targets_lost"] += all_targets - int(kept.sum())

        tokens = int(doc_len.sum())
        rows = max(0, -(-(tokens - 1) // seq_len))  # row r holds tokens [r*S, r*S + S + 1)
        concat = totals["concat_chunk"]
        _add(concat, rows, tokens + max(0, rows - 1), row, all_targets)
        # A target at g is a label of row (g - 1) // S, which starts before its document
        # (so attends to another one) iff g <= ((D - 1) // S + 1) * S for document start D > 0.
        later = doc_start > 0
        leak_end = np.minimum(((doc_start - 1) // seq_len + 1) * seq_len + 1, doc_start + doc_len)
        concat["cross_document_targets"] += int(
            (
                targets_before(ranges, leak_end[later]) - targets_before(ranges, doc_start[later])
            ).sum()
        )
        first_row = doc_start // seq_len
        last_row = np.maximum(doc_start + doc_len - 2, doc_start) // seq_len
        concat["split_documents"] += int(np.count_nonzero(last_row > first_row))
    for figures in totals.values():
        slots = max(1, figures["rows"] * row)
        figures["valid_context_ratio"] = figures["valid_context_tokens"] / slots
        figures["padding_ratio"] = figures["padded_tokens"] / slots
    return {"seq_len": seq_len, **totals}


_QUALITY_KEYS = ("rows", "valid_context_tokens", "padded_tokens", "targets", "targets_lost")


def _add(figures: dict, rows: int, valid: int, row: int, targets: int) -> None:
    figures["rows"] += rows
    figures["valid_context_tokens"] += valid
    figures["padded_tokens"] += rows * row - valid
    figures["targets"] += targets
