"""What a corpus holds: counts, role mix, length histograms, the build's drop accounting and what
the build reported about the tokenizer's coverage and duplicates.

This is the descriptive half of ``nedolm-sft stats``; the packing half (windows, ratios,
baselines) comes from ``nedolm.data.stats``. Everything is read from the binaries and
SHARD_MANIFEST.json, vectorised per shard.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from nedolm.data.contract import SHARD_MANIFEST_FILE
from nedolm.data.format import discover_shards
from nedolm.data.records import ROLE_NAMES
from nedolm.data.roles import audit_roles, role_totals


def length_histogram(lengths: np.ndarray) -> dict[str, int]:
    """Counts per power-of-two bucket ``"[lo, hi)"``, for lengths >= 1."""
    if not len(lengths):
        return {}
    exponents = np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    counts = np.bincount(exponents)
    return {f"[{1 << e}, {1 << (e + 1)})": int(c) for e, c in enumerate(counts) if c}


def corpus_summary(data_dir: Path) -> dict[str, Any]:
    """Documents, messages per role, token counts, length histograms, drop reasons."""
    data_dir = Path(data_dir)
    shards = discover_shards(data_dir)
    doc_lengths, message_lengths, roles, audits = [], [], [], []
    for shard in shards:
        doc_lengths.append(np.asarray(shard.index["token_len"], np.int64))
        segments = shard.segments
        message_lengths.append(segments["length"].astype(np.int64))
        roles.append(np.asarray(segments["role"]))
        audits.append(audit_roles(segments))
    docs = np.concatenate(doc_lengths)
    lengths, role = np.concatenate(message_lengths), np.concatenate(roles)
    counts = role_totals(audits)
    summary: dict[str, Any] = {
        "shards": len(shards),
        "documents": len(docs),
        "messages": len(lengths),
        "tokens_including_eos": int(docs.sum()),
        "messages_by_role": {n: counts[n] for n in ROLE_NAMES if n in counts},
        "assistant_trainable_messages": counts["assistant_trainable"],
        "assistant_context_messages": counts["assistant_context"],
        "document_tokens": {
            "mean": float(docs.mean()),
            "max": int(docs.max()),
            "histogram": length_histogram(docs),
        },
        "message_tokens_by_role": {
            n: length_histogram(lengths[role == c]) for c, n in enumerate(ROLE_NAMES) if n in counts
        },
    }
    manifest_path = data_dir / SHARD_MANIFEST_FILE
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        sources = manifest.get("build", {}).get("sources", [])
        dropped: Counter[str] = Counter()
        for source in sources:
            dropped.update(source.get("dropped", {}))
        summary["validation_shard_ids"] = manifest.get("validation_shard_ids", [])
        summary["input_records"] = sum(s.get("records", 0) for s in sources)
        summary["dropped"] = dict(sorted(dropped.items()))
        summary["sources"] = sources
        summary["reported"] = {key: _total(sources, key) for key in REPORTED}
    return summary


REPORTED = {
    "unk_target_tokens": "<unk> ids in targets",
    "lost_characters": "characters the tokenizer does not round-trip",
    "duplicate_conversations": "exact duplicate conversations",
}
"""Per-source counts the builder reports (``contract.SourceEntry``), summed by ``stats``."""


def _total(sources: list[dict[str, Any]], key: str) -> int | None:
    """The sum over sources; None when a source predates the count."""
    values = [source.get(key) for source in sources]
    return None if any(v is None for v in values) else sum(values)
