"""Data parallelism for the MorphTransformer: DDP (replicated) or FSDP2 (sharded), one call.

``parallelize(model, "ddp" | "fsdp", ...)`` returns the module the step calls. Under FSDP2
(``torch.distributed.fsdp.fully_shard``) each block is its own unit, so only one block's full
parameters exist at a time, and the root unit holds the tied embedding/head and the final
norm. Both modes average gradients over ranks, so the step's ``world_size / global_targets``
loss scale gives the exact global mean under either. Without a process group the model is
returned unchanged in both modes: one process has nothing to replicate or shard.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Literal, get_args

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from nedolm.dist import is_distributed
from nedolm.model import MorphTransformer
from nedolm.train.precision import COMPUTE_DTYPES, ComputePrecision

Parallelism = Literal["ddp", "fsdp"]


def mixed_precision_policy(compute: ComputePrecision) -> MixedPrecisionPolicy:
    """FSDP2's compute dtype; sharded master weights, AdamW states and the gradient
    reduce-scatter stay fp32.

    Gradients are summed over ranks in fp32 in every mode (torchtitan's default), as DDP's
    all-reduce sums them: a bf16 sum over ranks would lose precision DDP keeps, and a run may
    switch between the two at any checkpoint.

    Raises:
        ValueError: ``compute`` is not a resolved precision (``auto`` is resolved before).
    """
    if compute not in COMPUTE_DTYPES:
        raise ValueError(
            f"compute precision must be one of {tuple(COMPUTE_DTYPES)} (train.precision as "
            f"resolve_precision resolves it), got {compute!r}"
        )
    return MixedPrecisionPolicy(param_dtype=COMPUTE_DTYPES[compute], reduce_dtype=torch.float32)


def parallelize(
    model: MorphTransformer,
    mode: Parallelism,
    *,
    device: torch.device,
    compute: ComputePrecision,
    ddp_bucket_cap_mb: float = 25.0,
    ddp_static_graph: bool = False,
) -> nn.Module:
    """Wrap ``model`` (already on ``device``, identical on every rank) for data parallelism.

    Build the optimizer *after* this call: under FSDP the parameters become sharded DTensors
    (same names, same global shapes), and the optimizer must hold those.

    Args:
        model: the bare (uncompiled) model; FSDP shards it in place.
        mode: "ddp" replicates, "fsdp" shards parameters, gradients and optimizer states.
        device: this rank's device.
        compute: the resolved precision (``resolve_precision``), FSDP's compute dtype
            (``mixed_precision_policy``); DDP's is the autocast around its forward, which is the
            caller's.
        ddp_bucket_cap_mb: DDP gradient bucket size.
        ddp_static_graph: DDP static-graph optimisation.

    Returns:
        The DDP wrapper, or ``model`` itself turned into an FSDP module (also returned
        unchanged when no process group is initialised).

    Raises:
        ValueError: unknown ``mode`` or ``compute``.
    """
    if mode not in get_args(Parallelism):
        raise ValueError(f"parallelism must be one of {get_args(Parallelism)}, got {mode!r}")
    policy = mixed_precision_policy(compute)  # checked in both modes
    if not is_distributed():
        return model
    if mode == "ddp":
        return DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            **no_buffer_sync_per_forward(DistributedDataParallel),
            gradient_as_bucket_view=True,
            static_graph=ddp_static_graph,
            bucket_cap_mb=ddp_bucket_cap_mb,
        )
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    # The root unit gathers the embedding (also the tied head) and the final norm; it stays
    # gathered between forward and backward because the head reuses it at the very end.
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)
    return model


def no_buffer_sync_per_forward(ddp_class: type) -> dict[str, bool]:
    """DDP's keyword that stops it broadcasting buffers before every forward (they are the rope
    tables and the morph classes, equal on every rank): ``forward_sync_buffers`` since torch
    2.13, ``broadcast_buffers`` (deprecated there, the only one before: torch 2.10 and 2.11
    refuse the new keyword with a TypeError)."""
    parameters = inspect.signature(ddp_class.__init__).parameters
    keyword = (
        "forward_sync_buffers" if "forward_sync_buffers" in parameters else "broadcast_buffers"
    )
    return {keyword: False}


def unwrap(model: nn.Module) -> nn.Module:
    """The module whose ``state_dict`` names match the bare model (DDP adds ``module.``)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def is_sharded(model: nn.Module) -> bool:
    """True for a model returned by ``parallelize(..., "fsdp")`` in a process group."""
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def maybe_no_sync(model: nn.Module, *, last_micro_batch: bool) -> Iterator[None]:
    """Skip DDP's gradient all-reduce on every micro-batch but the step's last.

    FSDP reduce-scatters every micro-batch instead: deferring it would keep a full-size
    unsharded gradient per rank, the memory FSDP exists to save.
    """
    if last_micro_batch or not isinstance(model, DistributedDataParallel):
        yield
        return
    with model.no_sync():
        yield


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor: the replicated value of a DTensor (e.g. FSDP's clipped grad norm)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
