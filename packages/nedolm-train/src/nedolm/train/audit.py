"""An optional record of what each rank trained, for exactly-once audits of the data stream.

With ``NEDOLM_AUDIT_DIR`` set, every batch the loop draws is noted (the global window id of
each row, its target count and the sum of its target token ids), and after each optimizer
step every rank appends one JSON line to ``rank-{rank}.jsonl`` in that directory::

    {"step": 5, "windows": [12, 30], "targets": [41, 17], "target_token_sums": [..],
     "global_targets": 101}

An auditor recomputes targets and token sums of those windows from the shards themselves and
checks coverage per epoch and the step's loss normalisation (``global_targets``). Unset, the
loop uses the loader's iterator directly and nothing is recorded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from nedolm.data.loader import SFTLoader

AUDIT_DIR_VARIABLE = "NEDOLM_AUDIT_DIR"


class BatchAudit:
    """Notes the batches of one rank as they pass and writes them per optimizer step."""

    def __init__(self, loader: SFTLoader, rank: int, directory: Path) -> None:
        self.loader = loader
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"rank-{rank}.jsonl"
        self.pending: dict[str, list[int]] = {"windows": [], "targets": [], "sums": []}

    @classmethod
    def from_env(cls, loader: SFTLoader, rank: int) -> BatchAudit | None:
        directory = os.environ.get(AUDIT_DIR_VARIABLE)
        return cls(loader, rank, Path(directory)) if directory else None

    def track(
        self, batches: Iterator[dict[str, torch.Tensor]]
    ) -> Iterator[dict[str, torch.Tensor]]:
        """``batches``, noting each one as it is handed to the step."""
        for batch in batches:
            mask = batch["trainable_mask"]
            self.pending["windows"] += self.loader.trained_windows(batch).tolist()
            self.pending["targets"] += mask.sum(dim=1).tolist()
            self.pending["sums"] += (batch["tokens"] * mask).sum(dim=1).tolist()
            yield batch

    def write_step(self, step: int, global_targets: int) -> None:
        """Append the batches noted since the last call as optimizer step ``step``."""
        record = {
            "step": step,
            "windows": self.pending["windows"],
            "targets": self.pending["targets"],
            "target_token_sums": self.pending["sums"],
            "global_targets": global_targets,
        }
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")
        self.pending = {"windows": [], "targets": [], "sums": []}
