"""Held-out validation: the exact mean assistant-target loss over a fixed set of batches.

Each pass reads the same first ``batches`` micro-batches of the validation loader on every rank
(a fresh iterator, so the set never drifts), and every rank exchanges its error status before
any metric all-reduce: a failure on one rank is raised on all of them instead of leaving the
healthy ones in a SUM that the failed one never enters.

A corpus built with ``prepare --val-input`` names the input each validation shard holds; the
pass then also sums the loss per input (each batch's rows grouped by the shard they come
from), riding the same all-reduce, so ``loss_by_source`` costs no collective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from nedolm.data.loader import SFTLoader
from nedolm.dist import DistInfo, collect_rank_errors, sum_all
from nedolm.train.faults import maybe_inject
from nedolm.train.memory import DEFAULT_ADVICE, MemoryAdvice, is_out_of_memory
from nedolm.train.step import LossOptions, StepError, loss_sum, to_micro_batch


@dataclass(frozen=True)
class ValidationResult:
    loss: float
    """Mean loss per assistant target over all ranks."""
    targets: int
    context_tokens: int
    loss_by_source: dict[str, float] = field(default_factory=dict)
    """Per validation input with targets in the pass: its mean loss per target."""
    targets_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def ppl(self) -> float:
        return math.exp(min(20.0, self.loss))


@torch.no_grad()
def run_validation(
    model: nn.Module,
    loader: Iterable[dict[str, Any]],
    info: DistInfo,
    *,
    batches: int,
    eos_id: int,
    options: LossOptions,
    sources: Mapping[int, str] | None = None,
    memory: MemoryAdvice = DEFAULT_ADVICE,
) -> ValidationResult:
    """Evaluate ``model`` (the bare module, not the DDP/compiled wrapper) on ``batches`` batches.

    ``sources`` maps validation shard ids to the input they hold (``read_validation_sources``;
    ``loader`` is then an ``SFTLoader``); rows of other shards count in the overall loss only.
    ``memory`` words the error when a batch does not fit.

    Raises:
        OutOfMemory: on every rank, when a batch did not fit on some rank.
        StepError: on every rank, when any rank failed otherwise or the global target count is
            zero.
    """
    was_training = model.training
    model.eval()
    names = sorted(set(sources.values())) if sources else []
    # loss, targets, context; then loss, targets of each of ``names``
    totals = torch.zeros(3 + 2 * len(names), dtype=torch.float64, device=info.device)
    local_error = memory_error = ""
    try:
        maybe_inject("validation", info.rank)
        it = iter(loader)
        for _ in range(batches):
            batch = next(it)
            groups = _source_rows(loader, batch, sources, names) if names else [(None, None)]
            for source, rows in groups:
                part = batch if rows is None else {k: v[rows] for k, v in batch.items()}
                mb = to_micro_batch(part, info.device, eos_id)
                loss = loss_sum(model, mb, options)
                totals[0] += loss.double()  # not read per batch: each read waits for the GPU
                totals[1] += mb.targets
                totals[2] += mb.inputs.numel()
                if source is not None:
                    totals[3 + 2 * source] += loss.double()
                    totals[4 + 2 * source] += mb.targets
    except Exception as exc:  # reported to every rank below, never raised alone
        failure = f"{type(exc).__name__}: {exc}"
        if is_out_of_memory(exc):
            memory_error = failure
        else:
            local_error = failure
    finally:
        model.train(was_training)
    memory_errors = collect_rank_errors(info, memory_error)
    if memory_errors:
        raise memory.error("in validation", memory_errors, validation=True)
    errors = collect_rank_errors(info, local_error)
    if errors:
        raise StepError("validation failed: " + " | ".join(errors))
    loss_total, targets, context, *per_source = sum_all(totals).tolist()
    if targets <= 0:
        raise StepError("validation set has zero assistant targets")
    if not math.isfinite(loss_total):  # a NaN or infinity on any rank reaches the sum
        raise StepError(f"validation failed: non-finite validation loss ({loss_total})")
    by_source = {
        name: (loss, int(count))
        for name, loss, count in zip(names, per_source[::2], per_source[1::2], strict=True)
        if count > 0
    }
    return ValidationResult(
        loss_total / targets,
        int(targets),
        int(context),
        {name: loss / count for name, (loss, count) in by_source.items()},
        {name: count for name, (_, count) in by_source.items()},
    )


def _source_rows(
    loader: Iterable[dict[str, Any]],
    batch: dict[str, torch.Tensor],
    sources: Mapping[int, str],
    names: list[str],
) -> list[tuple[int | None, torch.Tensor]]:
    """(index into ``names`` or None, row indices) of each group of the batch's rows that come
    from the same validation input (None: a shard that names no input)."""
    if not isinstance(loader, SFTLoader):
        raise TypeError("per-source validation needs the SFTLoader, which knows each row's shard")
    dataset = loader.dataset
    windows = loader.trained_windows(batch)
    shard_at = np.searchsorted(dataset.shard_offsets, windows, side="right") - 1
    shard_ids = [dataset.shards[i].shard_id for i in shard_at.tolist()]
    index = {name: i for i, name in enumerate(names)}
    of_row = [index.get(sources.get(shard, ""), -1) for shard in shard_ids]
    groups = []
    for source in sorted(set(of_row)):
        rows = torch.tensor([r for r, s in enumerate(of_row) if s == source], dtype=torch.long)
        groups.append((None if source < 0 else source, rows))
    return groups
