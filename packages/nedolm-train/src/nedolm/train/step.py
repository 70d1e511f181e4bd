"""One optimizer step: ``train_step`` fetches every micro-batch, agrees on the global target
count, runs ``forward_backward`` per micro-batch, clips and steps.

The loss of a step is the exact mean over every assistant target of every micro-batch on every
rank: each micro-batch's *summed* loss is scaled by ``world_size / global_targets`` (DDP then
averages over ranks), so short-target micro-batches are not over-weighted as a per-micro-batch
mean would do. Fetch failures, the target count and stop requests travel in one SUM
all-reduce, so the hot path has a single tiny collective and a rank whose loader failed cannot
strand its peers. That collective's host read is a sync every rank must make before its
forward pass, to know whether any rank failed (else a healthy rank would wait forever in DDP's
gradient all-reduce); the target count and the stop flag ride in the same read for free, so a
stop requested on any rank is agreed on by every rank at the next optimizer step. A single
process has nothing to agree on and reads nothing there. The other read of a step is the
gradient norm (``clip_grad_norm``): on one GPU the device's queue drains once per step. A step
that ends a log window reads the window's loss right after the norm, while nothing is queued
(``LossWindow``), so the log line never waits for AdamW.

``forward_backward`` is the one way the model is called for training: the compile warm-up calls
it too, with a batch of the same shape, so it compiles the graph that training runs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nedolm.dist import DistInfo, collect_rank_errors, sum_all
from nedolm.model import IGNORE_INDEX, host_to_device, packed_layout
from nedolm.train.faults import maybe_inject
from nedolm.train.memory import DEFAULT_ADVICE, MemoryAdvice, is_out_of_memory
from nedolm.train.parallel import local_tensor, maybe_no_sync


class StepError(RuntimeError):
    """An optimizer step cannot be taken; raised with the same message on every rank."""


class NonFiniteGradNorm(RuntimeError):
    """The gradient norm is inf or nan: no gradient was scaled, the step must not be taken."""


@dataclass(frozen=True)
class LossOptions:
    """How the loss is computed (fixed for a run)."""

    assistant_only_head: bool
    """Fused head: projection + cross-entropy at target positions only."""
    loss_fp32_logits: bool
    use_amp: bool
    """bf16 autocast: ``train.precision`` resolved to bf16 (``resolve_precision``)."""


@dataclass(frozen=True)
class StepSettings:
    """Everything an optimizer step needs besides the model, optimizer and data (fixed)."""

    info: DistInfo
    eos_id: int
    grad_accum_steps: int
    """Micro-batches per optimizer step on each rank."""
    grad_clip: float
    loss: LossOptions
    memory: MemoryAdvice = DEFAULT_ADVICE
    """What the run can change when a step does not fit (named in the error raised)."""


@dataclass(frozen=True)
class StepResult:
    loss_sum: Tensor
    """This rank's summed target loss, on the device (a ``LossWindow`` given to the step adds it
    up for the log line)."""
    grad_norm: float
    global_targets: int
    """Assistant targets of the step over every rank."""
    stop: bool
    """Some rank asked to stop before this step's fetch: every rank stops after this step."""


@dataclass(frozen=True)
class MicroBatch:
    """A loader batch turned into model inputs on the training device."""

    inputs: Tensor  # [B, S] token ids
    labels: Tensor  # [B, S] next-token targets, IGNORE_INDEX where not trained
    cu_seqlens: Tensor  # int32 [N + 1] segment offsets (EOS and row starts)
    position_ids: Tensor  # [B, S], 0 at every segment start
    target_index: Tensor  # int64 [TARGET_ROWS * k] flattened target positions, -1 padded
    targets: int  # number of trained positions
    max_seqlen: int  # longest segment: sizes the kernel backends' grids (not the row length)
    host_cu_seqlens: Tensor  # cu_seqlens on the CPU: the sdpa backend plans without a device read

    def layout(self) -> dict[str, Any]:
        """The packing keywords of the model's forward."""
        return {
            "cu_seqlens": self.cu_seqlens,
            "max_seqlen": self.max_seqlen,
            "position_ids": self.position_ids,
            "host_cu_seqlens": self.host_cu_seqlens,
        }


TARGET_ROWS = 128
"""The fused head scores a multiple of this many rows (padding rows add nothing)."""


def to_micro_batch(batch: dict[str, Tensor], device: torch.device, eos_id: int) -> MicroBatch:
    """Inputs are tokens[:, :-1]; labels tokens[:, 1:] where trainable_mask[:, 1:] holds.

    Everything is derived on the CPU from the loader's (pinned) batch, so no step of it waits
    for the device, and then copied over without blocking. What varies from batch to batch,
    the segment and the target counts, is marked dynamic for torch.compile (the target rows
    are also padded to a multiple of ``TARGET_ROWS``, never fewer; the longest segment is
    made dynamic by ``nedolm.train.compiling``), so a compiled model is traced once; the
    token tensors get canonical strides (a [1, S] view of the [1, S + 1] rows would
    otherwise recompile it).
    """
    tokens, mask = batch["tokens"].long(), batch["trainable_mask"][:, 1:]
    inputs = tokens[:, :-1].clone(memory_format=torch.contiguous_format)
    labels = torch.where(mask, tokens[:, 1:], IGNORE_INDEX)
    cu_seqlens, position_ids = packed_layout(inputs, eos_id)
    positions = mask.reshape(-1).nonzero().squeeze(1)
    target_index = torch.full((_padded_rows(positions.numel()),), -1, dtype=torch.long)
    target_index[: positions.numel()] = positions
    host = (inputs, labels, cu_seqlens, position_ids, target_index)
    bounds = cu_seqlens.tolist()  # host memory: plain Python, no tensor op per batch
    longest = max(end - start for start, end in itertools.pairwise(bounds))
    mb = MicroBatch(
        *(host_to_device(t, device) for t in host),
        targets=positions.numel(),
        max_seqlen=longest,
        host_cu_seqlens=cu_seqlens,
    )
    for varying in (mb.cu_seqlens, mb.host_cu_seqlens, mb.target_index):
        torch._dynamo.maybe_mark_dynamic(varying, 0)
    return mb


def _padded_rows(targets: int) -> int:
    return max(1, -(-targets // TARGET_ROWS)) * TARGET_ROWS


def loss_sum(model: nn.Module, mb: MicroBatch, options: LossOptions) -> Tensor:
    """Summed cross-entropy over the micro-batch's targets."""
    return _cross_entropy(model, mb, options, "sum")


def target_losses(model: nn.Module, mb: MicroBatch, options: LossOptions) -> Tensor:
    """Each target's cross-entropy, float32, in ``mb.target_index``'s order (0 at its padding
    entries), without gradients: what an evaluation that splits the loss by row sums, after
    one forward over the whole micro-batch."""
    return _cross_entropy(model, mb, options, "none")


def _cross_entropy(
    model: nn.Module, mb: MicroBatch, options: LossOptions, reduction: str
) -> Tensor:
    layout = mb.layout()
    with torch.autocast(mb.inputs.device.type, dtype=torch.bfloat16, enabled=options.use_amp):
        if options.assistant_only_head:
            loss, _ = model(
                mb.inputs,
                labels=mb.labels,
                return_logits=False,
                loss_reduction=reduction,
                loss_fp32_logits=options.loss_fp32_logits,
                target_index=mb.target_index,
                **layout,
            )
            return loss
        _, logits = model(mb.inputs, return_logits=True, **layout)
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(),
            mb.labels.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction=reduction,
        )
    if reduction != "none":
        return loss
    padding = mb.target_index < 0
    return loss.index_select(0, mb.target_index.clamp_min(0)).masked_fill(padding, 0.0)


class StepBatches(NamedTuple):
    """A step's micro-batches on this rank and what every rank agreed on while fetching."""

    micro_batches: list[MicroBatch]
    global_targets: int
    stop: bool
    """Some rank asked to stop."""


def fetch_step_batches(
    batches: Iterator[dict[str, Any]], settings: StepSettings, step: int, *, local_stop: bool
) -> StepBatches:
    """Pull the step's micro-batches on every rank and agree on the global target count and on
    stopping (``local_stop``: this rank's request) in the step's one all-reduce.

    Raises:
        StepError: on every rank, when any rank failed to fetch or has no target in the step.
    """
    info = settings.info
    micro_batches: list[MicroBatch] = []
    local_error = ""
    try:
        maybe_inject("data_fetch", info.rank)
        for _ in range(settings.grad_accum_steps):
            micro_batches.append(to_micro_batch(next(batches), info.device, settings.eos_id))
        if sum(mb.targets for mb in micro_batches) == 0:
            raise RuntimeError(f"optimizer step {step} has zero assistant targets on this rank")
    except Exception as exc:  # reported to every rank below, never raised alone
        local_error = f"{type(exc).__name__}: {exc}"
    status = [sum(mb.targets for mb in micro_batches), int(bool(local_error)), int(local_stop)]
    if info.world_size > 1:
        on_device = torch.tensor(status, dtype=torch.int64, device=info.device)
        status = sum_all(on_device).tolist()
    global_targets, failed, stops = status
    if failed:
        errors = collect_rank_errors(info, local_error)
        raise StepError(f"batch fetch failed at optimizer step {step}: " + " | ".join(errors))
    return StepBatches(micro_batches, global_targets, stops > 0)


def forward_backward(
    model: nn.Module, mb: MicroBatch, options: LossOptions, scale: float
) -> Tensor:
    """Backpropagate ``scale`` times the micro-batch's summed loss; returns that sum, detached."""
    loss = loss_sum(model, mb, options)
    (loss * scale).backward()
    return loss.detach().float()


_CLIP_EPS = 1e-6
"""What ``torch.nn.utils.clip_grads_with_norm_`` adds to the norm before dividing."""


def clip_grad_norm(params: list[Tensor], max_norm: float) -> float:
    """Scale the gradients to a global L2 norm of at most ``max_norm``; returns the norm before
    clipping (summed in float64, also when the gradients are FSDP's sharded DTensors).

    The squares are summed in float64. A float32 norm of a large gradient on CPU is off by
    ~1e-5 (the 32k-row embedding), and off differently for each split of the sum: DDP (whole
    tensors) and FSDP (row shards) clipped by factors 1.5e-6 apart, which AdamW grew to 1e-5 in
    the weights within 10 steps. In float64 both modes clip by the same factor.

    The norm is read on the host (the step's one read after backward, needed to refuse a
    non-finite norm), so when it is within ``max_norm`` the gradients are left alone: torch's
    factor would be exactly 1.0, and multiplying every gradient by it is a pass over all of
    them (~1.5 ms of an H200 for 0.8B float32 gradients) that changes no bit.

    Raises:
        NonFiniteGradNorm: the norm is not finite (no gradient is scaled).
    """
    grads = [p.grad for p in params if p.grad is not None]
    norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]
    total = local_tensor(torch.linalg.vector_norm(torch.stack(norms)))
    norm = float(total)
    if not math.isfinite(norm):
        raise NonFiniteGradNorm(f"the gradient norm is {norm}")
    if max_norm / (norm + _CLIP_EPS) < 1.0:  # torch's factor, in the same float64 arithmetic
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return norm


class LossWindow:
    """The summed loss of the steps since the last log line, on the device; ``read`` sums it
    over ranks into ``value`` (every rank reads at the same steps: it is a collective)."""

    def __init__(self, device: torch.device) -> None:
        self.total = torch.zeros((), dtype=torch.float32, device=device)
        self.read_now = False
        """Set by the caller for a step that ends with a log line."""
        self.value: float | None = None

    def read(self) -> None:
        self.value = sum_all(self.total.clone()).item()


def train_step(
    model: nn.Module,
    params: list[Tensor],
    optimizer: torch.optim.Optimizer,
    batches: Iterator[dict[str, Any]],
    settings: StepSettings,
    step: int,
    *,
    local_stop: bool = False,
    loss_window: LossWindow | None = None,
) -> StepResult:
    """Fetch, accumulate, clip (refusing non-finite norms) and step (0-based ``step``);
    ``local_stop`` is this rank's stop request, agreed on with the other ranks' in the fetch.

    ``model`` may be the DDP wrapper (gradients all-reduced on the last micro-batch only) or
    an FSDP module (``params`` are then sharded DTensors; the norm is the global one).
    ``loss_window`` adds the step's loss to a log window, and reads the window when asked to,
    right after the gradient norm's read: the device has just finished backward there and
    nothing is queued, so the read waits for nothing (after ``optimizer.step()`` it would wait
    for AdamW and leave the device idle while the host logs).
    """
    micro_batches, global_targets, stop = fetch_step_batches(
        batches, settings, step, local_stop=local_stop
    )
    scale = settings.info.world_size / global_targets
    local_loss = torch.zeros((), dtype=torch.float32, device=micro_batches[0].inputs.device)
    try:
        for i, mb in enumerate(micro_batches):
            with maybe_no_sync(model, last_micro_batch=i == len(micro_batches) - 1):
                local_loss += forward_backward(model, mb, settings.loss, scale)
        if loss_window is not None:
            loss_window.total += local_loss
        grad_norm = clip_grad_norm(params, settings.grad_clip)
        if loss_window is not None and loss_window.read_now:
            loss_window.read()
        optimizer.step()  # its first call allocates AdamW's moments
    except NonFiniteGradNorm as exc:  # same all-reduced gradients, so every rank raises
        raise StepError(f"non-finite gradient norm at optimizer step {step}: {exc}") from exc
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        cause = f"{type(exc).__name__}: {exc}"
        raise settings.memory.error(f"at optimizer step {step}", [cause]) from exc
    optimizer.zero_grad(set_to_none=True)
    return StepResult(local_loss, grad_norm, global_targets, stop)
