"""Out-of-memory failures named as such, with the keys of the run's config that make the step
fit.

torch reports an exhausted allocator as ``torch.OutOfMemoryError`` (CUDA: its message names the
device's capacity and what this process holds) or, on the CPU, as a RuntimeError of its
allocator; compiled code may wrap either. Left alone, a micro-batch too large for the GPU ends
the run with torch's message and no word of which key to change, and in the compile warm-up it
read as an attention-backend failure ("choose another attn_impl"), which no backend would fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nedolm.train.config import SFTConfig

CPU_ALLOCATOR_FAILURE = "DefaultCPUAllocator: can't allocate memory"
"""How torch's CPU allocator says it (a RuntimeError, not ``torch.OutOfMemoryError``)."""


class OutOfMemory(RuntimeError):
    """A training step, a validation pass or the compile warm-up did not fit in memory."""


def is_out_of_memory(exc: BaseException) -> bool:
    """True if ``exc``, or an exception it was raised from, is an allocation failure."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (torch.OutOfMemoryError, MemoryError)):
            return True
        if CPU_ALLOCATOR_FAILURE in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@dataclass(frozen=True)
class MemoryAdvice:
    """What a run can change when its steps or its validation do not fit: ``memory_advice``
    words it from the run's config (the shape that failed, then its keys); the defaults serve
    callers of the step without a config (benches, tests)."""

    train: str = "to fit, use smaller micro-batches or gradient checkpointing"
    validation: str = "to fit, use smaller validation micro-batches"

    def error(self, where: str, causes: Sequence[str], *, validation: bool = False) -> OutOfMemory:
        """The error to raise for an allocation failure ``where`` (e.g. "at optimizer step 3");
        ``causes``: torch's messages (one per failing rank)."""
        advice = self.validation if validation else self.train
        return OutOfMemory(f"out of memory {where}: {advice}. {' | '.join(causes)}")


DEFAULT_ADVICE = MemoryAdvice()
"""For a step or validation pass called without a run's config."""


def memory_advice(cfg: SFTConfig, seq_len: int, world_size: int) -> MemoryAdvice:
    """The advice for ``cfg`` trained at ``seq_len`` on ``world_size`` ranks."""
    t = cfg.train
    train_keys: list[str] = []
    validation_keys: list[str] = []
    if not t.assistant_only_head:
        logits = "set train.assistant_only_head: true (the fused head never holds every logit)"
        train_keys.append(logits)
        validation_keys.append(logits)
    if t.micro_batch_size > 1:
        factor = _smallest_factor(t.micro_batch_size)
        train_keys.append(
            f"lower train.micro_batch_size (e.g. {t.micro_batch_size // factor} with "
            f"train.grad_accum_steps {t.grad_accum_steps * factor}: the same "
            f"{t.micro_batch_size * t.grad_accum_steps} windows per step on each rank)"
        )
    if not t.grad_checkpoint:
        train_keys.append("set train.grad_checkpoint: true (blocks recompute activations)")
    if world_size > 1 and t.parallelism == "ddp":
        train_keys.append(
            f"set train.parallelism: fsdp (weights, gradients and AdamW's moments sharded over "
            f"the {world_size} ranks)"
        )
    validation_rows = cfg.validation.micro_batch_size or t.micro_batch_size
    if validation_rows > 1:
        validation_keys.append(f"lower validation.micro_batch_size (now {validation_rows})")
    return MemoryAdvice(
        train=_advice(t.micro_batch_size, seq_len, train_keys),
        validation=_advice(validation_rows, seq_len, validation_keys),
    )


def _advice(rows: int, seq_len: int, keys: list[str]) -> str:
    shorter = f"prepare the corpus at a shorter --seq-len (now {seq_len})"
    return f"micro-batches of {rows} x {seq_len} tokens; to fit, " + "; ".join([*keys, shorter])


def _smallest_factor(n: int) -> int:
    """The smallest divisor of ``n`` above 1 (``n`` > 1)."""
    return next(f for f in range(2, n + 1) if n % f == 0)
