"""Base (pretraining) runs: their model config, their checkpoints, and ``init-base``.

A base run directory holds ``config.yaml`` (a ``RunConfig``: the model config and EOS id) and
``checkpoints/step-*.pt`` whose ``model`` entry is a MorphTransformer state dict, or a
``model.safetensors`` (``nedolm.train.base_weights``). SFT starts from the newest checkpoint,
else the safetensors file (or an explicit one). ``init_base`` writes a randomly
initialised base run of a preset for demos and tests.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec
import torch

from nedolm.model import ModelConfig, MorphTransformer, build_model, preset
from nedolm.train.base_weights import SAFETENSORS_WEIGHTS, base_weights_file
from nedolm.train.checkpoint import atomic_write, save_checkpoint
from nedolm.train.config import RunConfig

BASE_CONFIG_FILE = "config.yaml"


def model_config(run_config: RunConfig, **overrides: Any) -> ModelConfig:
    """The run's ModelConfig with ``overrides`` (fields set to None are left alone)."""
    fields = {**run_config.model, **{k: v for k, v in overrides.items() if v is not None}}
    return ModelConfig(**fields)


def resolve_base_checkpoint(base_run_dir: Path, explicit: Path | None) -> Path:
    """``explicit`` if given, else the base run's newest checkpoint or model.safetensors."""
    candidate = explicit if explicit is not None else base_weights_file(base_run_dir)
    if candidate is None:
        raise FileNotFoundError(
            f"no base checkpoint under {base_run_dir}/checkpoints and no "
            f"{base_run_dir}/{SAFETENSORS_WEIGHTS}"
        )
    if not candidate.is_file():
        raise FileNotFoundError(f"base checkpoint {candidate} does not exist")
    return candidate


def init_base(
    out_dir: Path,
    *,
    preset_name: str,
    vocab_size: int,
    eos_id: int,
    seed: int = 0,
    morph_classes: torch.Tensor | None = None,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a random base run of ``preset_name``: config.yaml + checkpoints/step-00000000.pt.

    Args:
        morph_classes: morph class per vocabulary id (``morph_classes_from_vocab``); without it
            every id keeps the model's default class.
        overrides: ModelConfig fields replacing the preset's (e.g. a smaller d_model).
    """
    cfg = preset(preset_name, **{**(overrides or {}), "vocab_size": vocab_size})
    torch.manual_seed(seed)
    model: MorphTransformer = build_model(cfg)
    if morph_classes is not None and cfg.n_morph_classes:
        model.set_morph_classes(morph_classes)
    run_config = RunConfig(model=dataclasses.asdict(cfg), eos_id=eos_id)
    text = msgspec.yaml.encode(run_config)
    atomic_write(Path(out_dir) / BASE_CONFIG_FILE, lambda handle: handle.write(text))
    payload = {"model": model.state_dict(), "step": 0, "model_config": dataclasses.asdict(cfg)}
    return save_checkpoint(Path(out_dir), 0, payload, keep_last=1, keep_every=0)
