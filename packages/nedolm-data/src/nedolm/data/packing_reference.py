"""The slow, obvious planner that ``packing.plan_shard`` is tested against.

It follows SPEC §3 word by word, one token and one item at a time: per-position target
flags, "the first target not yet trained", a scan over every message start, and best-fit
decreasing that looks at every open window for every item. It implements the same
tie-breaking as the fast planner (see ``packing``'s module docstring), so the two must
produce identical pieces, not merely equally good ones. Only for tests and small corpora.
"""

from __future__ import annotations

import numpy as np

from nedolm.data.packing import PIECE_DTYPE, PackingCounts, ShardPlan
from nedolm.data.records import ROLE_ASSISTANT


def plan_shard_reference(index: np.ndarray, segments: np.ndarray, seq_len: int) -> ShardPlan:
    """Same contract as ``packing.plan_shard``; quadratic, for tests."""
    window = seq_len + 1
    items = []  # (doc, start, end, target_from)
    trained_targets = 0
    continuations = {"turn": 0, "assistant": 0, "hard": 0}
    for doc, record in enumerate(index):
        first = int(record["segment_start"])
        messages = segments[first : first + int(record["segment_count"])]
        doc_len = int(record["token_len"])
        is_target = [False] * doc_len
        for m in messages:
            if m["trainable"]:
                for pos in range(int(m["start"] + m["header_len"]), int(m["start"] + m["length"])):
                    is_target[pos] = True
        if not any(is_target):
            continue
        if doc_len <= window:
            items.append((doc, 0, doc_len, 0))
            trained_targets += sum(is_target)
            continue
        trained = [False] * doc_len
        pending = [p for p in range(doc_len) if is_target[p]]
        if pending[0] < window:  # the first window: the document's first seq_len + 1 tokens
            items.append((doc, 0, window, 0))
            for p in range(window):
                trained[p] = trained[p] or is_target[p]
        while True:
            untrained = [p for p in pending if not trained[p]]
            if not untrained:
                break
            target = untrained[0]
            context_starts = [
                int(m["start"])
                for m in messages
                if m["role"] != ROLE_ASSISTANT and m["start"] <= target < m["start"] + window
            ]
            holder = next(m for m in messages if m["start"] <= target < m["start"] + m["length"])
            if context_starts:
                start, kind = max(context_starts), "turn"
            elif target - int(holder["start"]) < window:
                start, kind = int(holder["start"]), "assistant"
            else:
                start, kind = target - 1, "hard"
            continuations[kind] += 1
            end = min(start + window, doc_len)
            items.append((doc, start, end, target))
            for p in range(target, end):
                trained[p] = trained[p] or is_target[p]
        trained_targets += sum(trained)

    # Best-fit decreasing, one item at a time over every open window.
    items.sort(key=lambda it: (-(it[2] - it[1]), it[0]))  # stable: chain order kept
    bins: list[dict] = []  # free space, when it reached that free space, its items
    for clock, item in enumerate(items):
        size = item[2] - item[1]
        fitting = [b for b in bins if b["free"] >= size]
        if fitting:
            best = min(fitting, key=lambda b: (b["free"], b["since"]))
        else:
            best = {"free": window, "items": []}
            bins.append(best)
        best["free"] -= size
        best["since"] = clock
        best["items"].append(item)

    rows = [(w, *item) for w, b in enumerate(bins) for item in b["items"]]
    pieces = np.array(rows, dtype=PIECE_DTYPE) if rows else np.empty(0, PIECE_DTYPE)
    valid = sum(end - start for _, _, start, end, _ in rows)
    counts = PackingCounts(
        documents=len(index),
        windows=len(bins),
        raw_tokens=int(index["token_len"].astype(np.int64).sum()),
        valid_context_tokens=valid,
        padded_tokens=len(bins) * window - valid,
        assistant_target_tokens=trained_targets,
        turn_aligned_continuations=continuations["turn"],
        assistant_aligned_continuations=continuations["assistant"],
        hard_continuations=continuations["hard"],
    )
    return ShardPlan(pieces=pieces, counts=counts)
