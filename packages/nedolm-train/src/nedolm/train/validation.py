"""Held-out validation: the exact mean assistant-target loss over a fixed set of batches.

Each pass reads the same first ``batches`` micro-batches of the validation loader on every rank
(a fresh iterator, so the set never drifts), and every rank exchanges its error status before
any metric all-reduce: a failure on one rank is raised on all of them instead of leaving the
healthy ones in a SUM that the failed one never enters. Under FSDP the healthy ones are already
inside collectives (each forward gathers the blocks), which no status exchange can meet: there a
failure ends its own rank at once, as a failed training step does, and the launcher the rest.

A corpus built with ``prepare --val-input`` names the input each validation shard holds; the
pass then also sums the loss per input (each target's loss added to the input its row's shard
holds), riding the same all-reduce, so ``loss_by_source`` costs no collective. It is still one
forward per batch, on every rank: under FSDP each forward all-gathers every block, so a rank
running more forwards than another (as splitting batches by source would) would pair its
gathers with the wrong ones of its peers.
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
from nedolm.model import host_to_device
from nedolm.train.faults import maybe_inject
from nedolm.train.memory import DEFAULT_ADVICE, MemoryAdvice, is_out_of_memory
from nedolm.train.parallel import is_sharded
from nedolm.train.step import (
    LossOptions,
    MicroBatch,
    StepError,
    loss_sum,
    target_losses,
    to_micro_batch,
)


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
        OutOfMemory: on every rank, when a batch did not fit on some rank (under FSDP: on that
            rank).
        StepError: on every rank, when any rank failed otherwise (under FSDP: on that rank) or
            the global target count is zero.
    """
    was_training = model.training
    model.eval()
    names = sorted(set(sources.values())) if sources else []
    # loss, targets, context; then loss, targets of each of ``names``
    totals = torch.zeros(3 + 2 * len(names), dtype=torch.float64, device=info.device)
    # per source, the last one for rows of no input: loss on the device, targets on the host
    loss_by_source = torch.zeros(len(names) + 1, dtype=torch.float64, device=info.device)
    targets_by_source = torch.zeros(len(names) + 1, dtype=torch.float64)
    local_error = memory_error = ""
    try:
        maybe_inject("validation", info.rank)
        it = iter(loader)
        for _ in range(batches):
            batch = next(it)
            mb = to_micro_batch(batch, info.device, eos_id)
            if sources and names:
                row_source_B = _row_sources(loader, batch, sources, names)
                losses_N = target_losses(model, mb, options).double()
                loss = losses_N.sum()  # as each source sums it
                loss_by_source.index_add_(0, _target_sources(mb, row_source_B), losses_N)
                row_targets_B = batch["trainable_mask"][:, 1:].sum(1)  # as ``mb.targets`` counts
                targets_by_source.index_add_(0, row_source_B, row_targets_B.double())
            else:
                loss = loss_sum(model, mb, options)
            totals[0] += loss.double()  # not read per batch: each read waits for the GPU
            totals[1] += mb.targets
            totals[2] += mb.inputs.numel()
        totals[3::2] = loss_by_source[:-1]
        totals[4::2] = host_to_device(targets_by_source[:-1], info.device)
    except Exception as exc:  # reported to every rank below, never raised alone (but FSDP's)
        failure = f"{type(exc).__name__}: {exc}"
        if is_sharded(model):  # the peers wait in this pass's block gathers
            cause = f"rank {info.rank}: {failure}"  # as collect_rank_errors words it
            if is_out_of_memory(exc):
                raise memory.error("in validation", [cause], validation=True) from exc
            raise StepError(f"validation failed: {cause}") from exc
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


def _target_sources(mb: MicroBatch, row_source_B: torch.Tensor) -> torch.Tensor:
    """The source of each entry of ``mb.target_index``, on the device: its row's (row 0's for a
    padding entry, whose loss is 0)."""
    rows_N = mb.target_index.clamp_min(0) // mb.inputs.size(1)
    return host_to_device(row_source_B, mb.inputs.device)[rows_N]


def _row_sources(
    loader: Iterable[dict[str, Any]],
    batch: dict[str, torch.Tensor],
    sources: Mapping[int, str],
    names: list[str],
) -> torch.Tensor:
    """The index into ``names`` of the validation input each row of the batch comes from, or
    ``len(names)`` for a shard that names none (int64 [B], on the CPU)."""
    if not isinstance(loader, SFTLoader):
        raise TypeError("per-source validation needs the SFTLoader, which knows each row's shard")
    dataset = loader.dataset
    windows = loader.trained_windows(batch)
    shard_at = np.searchsorted(dataset.shard_offsets, windows, side="right") - 1
    index = {name: i for i, name in enumerate(names)}
    return torch.tensor(
        [
            index.get(sources.get(dataset.shards[i].shard_id, ""), len(names))
            for i in shard_at.tolist()
        ],
        dtype=torch.long,
    )
