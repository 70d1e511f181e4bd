"""Held-out validation: the exact mean assistant-target loss over a fixed set of batches.

Each pass reads the same first ``batches`` micro-batches of the validation loader on every rank
(a fresh iterator, so the set never drifts), and every rank exchanges its error status before
any metric all-reduce: a failure on one rank is raised on all of them instead of leaving the
healthy ones in a SUM that the failed one never enters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nedolm.dist import DistInfo, collect_rank_errors, sum_all
from nedolm.train.faults import maybe_inject
from nedolm.train.step import LossOptions, StepError, loss_sum, to_micro_batch


@dataclass(frozen=True)
class ValidationResult:
    loss: float
    """Mean loss per assistant target over all ranks."""
    targets: int
    context_tokens: int

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
) -> ValidationResult:
    """Evaluate ``model`` (the bare module, not the DDP/compiled wrapper) on ``batches`` batches.

    Raises:
        StepError: on every rank, when any rank failed or the global target count is zero.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=info.device)  # loss, targets, context
    local_error = ""
    try:
        maybe_inject("validation", info.rank)
        it = iter(loader)
        for _ in range(batches):
            mb = to_micro_batch(next(it), info.device, eos_id)
            loss = loss_sum(model, mb, options)
            if not torch.isfinite(loss):
                raise RuntimeError("non-finite validation loss")
            totals[0] += loss.double()
            totals[1] += mb.targets
            totals[2] += mb.inputs.numel()
    except Exception as exc:  # reported to every rank below, never raised alone
        local_error = f"{type(exc).__name__}: {exc}"
    finally:
        model.train(was_training)
    errors = collect_rank_errors(info, local_error)
    if errors:
        raise StepError("validation failed: " + " | ".join(errors))
    loss_total, targets, context = sum_all(totals).tolist()
    if targets <= 0:
        raise StepError("validation set has zero assistant targets")
    return ValidationResult(loss_total / targets, int(targets), int(context))
