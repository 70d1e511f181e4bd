"""AdamW with decay groups, and the learning-rate schedules (warm-up + cosine/linear/wsd/constant).

The schedule is a pure function of the step so that a resumed run needs no scheduler state:
``lr_at_step(step)`` is the same number whether or not the job was restarted in between.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from nedolm.train.config import OptimConfig


def _no_decay_param_ids(model: nn.Module) -> set[int]:
    """Norm gains (and any other vector) and embedding tables: decaying them hurts quality."""
    ids = {id(p) for p in model.parameters() if p.ndim < 2}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            ids.add(id(module.weight))
    return ids


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over every trainable parameter; fused kernel when all of them live on CUDA.

    Tied weights appear once (``model.parameters()`` deduplicates), in the no-decay group when
    they belong to an embedding.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    skip = set() if cfg.decay_norms_and_embeddings else _no_decay_param_ids(model)
    groups = [
        {"params": [p for p in params if id(p) not in skip], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if id(p) in skip], "weight_decay": 0.0},
    ]
    on_cuda = all(p.is_cuda for p in params)
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        fused=on_cuda,
        foreach=None if on_cuda else True,
    )


def lr_at_step(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate of 0-based optimizer step ``step`` out of ``max_steps``.

    Warm-up (``cfg.warmup_for(max_steps)`` steps, ``W``) is linear from ``lr / W`` (step 0) to
    ``lr`` (step ``W - 1``); afterwards the schedule runs over the remaining steps down to
    ``lr * min_lr_ratio`` at the last step. ``wsd`` stays at ``lr`` and decays linearly over
    the last ``decay_fraction``.
    """
    if step < 0 or max_steps < 1:
        raise ValueError(f"need step >= 0 and max_steps >= 1, got {step}, {max_steps}")
    warmup = cfg.warmup_for(max_steps)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    min_lr = cfg.lr * cfg.min_lr_ratio
    span = max_steps - warmup
    if cfg.schedule == "constant" or span <= 1:
        return cfg.lr
    progress = min(1.0, (step - warmup) / (span - 1))
    if cfg.schedule == "cosine":
        return min_lr + (cfg.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - min_lr) * progress
    decay_steps = round(cfg.decay_fraction * span)
    decay_start = max_steps - decay_steps
    if step < decay_start or decay_steps == 0:
        return cfg.lr
    if decay_steps == 1:
        return min_lr
    decay_progress = min(1.0, (step - decay_start) / (decay_steps - 1))
    return cfg.lr - (cfg.lr - min_lr) * decay_progress


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every param group's learning rate."""
    for group in optimizer.param_groups:
        group["lr"] = lr
