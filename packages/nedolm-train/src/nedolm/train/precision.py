"""The dtype a run computes in: ``train.precision`` resolved against the device it runs on.

bf16 is what the 0.8B job wants on a GPU with bf16 tensor cores (compute capability 8.0,
Ampere, and later; ROCm's GPUs): fast matmuls and half the activation memory, with fp32 master
weights and AdamW states in both modes (DDP computes under bf16 autocast, FSDP2 with bf16
parameters). A GPU before Ampere (V100, T4) has no bf16 tensor cores, so ``auto`` trains there in
fp32 and says so, and an explicit ``bf16`` is refused at start-up with the GPU's name, as vLLM
and Hugging Face's Trainer refuse it, rather than crawling. On a CPU ``auto`` is fp32 (CPU bf16
matmuls are slow, and the tests compare modes in fp32); an explicit ``bf16`` runs there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, get_args

import torch

log = logging.getLogger(__name__)

Precision = Literal["auto", "bf16", "fp32"]
ComputePrecision = Literal["bf16", "fp32"]
COMPUTE_DTYPES: dict[ComputePrecision, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}
NATIVE_BF16_CAPABILITY = (8, 0)
"""The first NVIDIA compute capability with bf16 tensor cores (Ampere)."""


class PrecisionError(ValueError):
    """The asked precision cannot run well on this device; the message says what to set."""


@dataclass(frozen=True)
class Gpu:
    """What the precision choice needs to know of a CUDA device."""

    name: str
    capability: tuple[int, int]
    native_bf16: bool


def gpu_of(device: torch.device) -> Gpu | None:
    """``device``'s GPU, or None off CUDA. Per device, where torch's ``is_bf16_supported``
    asks the current one; the same rule: ROCm, or NVIDIA from compute capability 8.0."""
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    native = torch.version.hip is not None or capability >= NATIVE_BF16_CAPABILITY
    return Gpu(torch.cuda.get_device_name(device), capability, native)


def choose_precision(precision: str, gpu: Gpu | None) -> ComputePrecision:
    """``precision`` on ``gpu`` (None: a CPU): ``auto`` is bf16 exactly where bf16 is native.

    Raises:
        ValueError: unknown ``precision``.
        PrecisionError: ``bf16`` on a GPU without bf16 tensor cores.
    """
    if precision not in get_args(Precision):
        raise ValueError(f"precision must be one of {get_args(Precision)}, got {precision!r}")
    if precision == "fp32":
        return "fp32"
    if precision == "bf16":
        if gpu is not None and not gpu.native_bf16:
            raise PrecisionError(
                f"train.precision bf16: {_describe(gpu)} has no bf16 tensor cores (NVIDIA's "
                "start at compute capability 8.0, Ampere): set train.precision to fp32, or to "
                "auto (fp32 there, bf16 where it is native)"
            )
        return "bf16"
    return "bf16" if gpu is not None and gpu.native_bf16 else "fp32"


def resolve_precision(precision: str, device: torch.device) -> ComputePrecision:
    """``choose_precision`` for ``device``, logging what ``auto`` chose and why."""
    gpu = gpu_of(device)
    compute = choose_precision(precision, gpu)
    if precision == "auto":
        where = str(device) if gpu is None else _describe(gpu)
        why = "" if gpu is None or gpu.native_bf16 else ": no bf16 tensor cores"
        log.info("train.precision auto: %s on %s%s", compute, where, why)
    return compute


def _describe(gpu: Gpu) -> str:
    major, minor = gpu.capability
    return f"{gpu.name} (compute capability {major}.{minor})"
