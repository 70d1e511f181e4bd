"""Base (pretraining) runs: their model config, their checkpoints, ``init-base`` and ``import-hf``.

A base run directory holds ``config.yaml`` (a ``RunConfig``: the model config and EOS id) and
``checkpoints/step-*.pt`` whose ``model`` entry is a MorphTransformer state dict, or a
``model.safetensors`` (``nedolm.train.base_weights``). SFT starts from the newest checkpoint,
else the safetensors file (or an explicit one), or straight from a Hugging Face directory
(``base_hf_dir``). ``init_base`` writes a randomly initialised base run of a preset for demos
and tests; ``import_hf_base`` writes one from a Hugging Face checkpoint, with its tokenizer.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import msgspec
import torch

from nedolm.data.atomic import atomic_write_bytes
from nedolm.data.tokenizer import HF_TOKENIZER_FILE, copy_tokenizer_files, load_tokenizer
from nedolm.model import ModelConfig, MorphTransformer, build_model, preset
from nedolm.train.base_weights import read_base_weights
from nedolm.train.checkpoint import save_checkpoint
from nedolm.train.config import RunConfig, SFTConfig, load_run_config
from nedolm.train.hf_base import check_corpus_tokenizer, hf_base_config, load_hf_base

BASE_CONFIG_FILE = "config.yaml"
BASE_TOKENIZER_DIR = "tokenizer"  # import-hf keeps the base's tokenizer files here


def model_config(run_config: RunConfig, **overrides: Any) -> ModelConfig:
    """The run's ModelConfig with ``overrides`` (fields set to None are left alone)."""
    fields = {**run_config.model, **{k: v for k, v in overrides.items() if v is not None}}
    return ModelConfig(**fields)


def base_run_config(cfg: SFTConfig) -> RunConfig:
    """The base's RunConfig: read from base_config, or derived from base_hf_dir."""
    if cfg.base_hf_dir is None:
        assert cfg.base_config is not None  # SFTConfig guarantees one of the two
        return load_run_config(cfg.base_config)
    model_cfg, eos_id = hf_base_config(cfg.base_hf_dir, cfg.base_morph_expert_dim)
    return RunConfig(model=model_cfg.to_dict(), eos_id=eos_id, tokenizer=HF_TOKENIZER_FILE)


def check_base_tokenizer(cfg: SFTConfig, run_config: RunConfig) -> None:
    """Refuse a corpus prepared with another tokenizer than the base's (when the base names one).

    Raises:
        TokenizerMismatchError: names both tokenizers and the first difference.
    """
    if run_config.tokenizer is None:
        return
    root = cfg.base_hf_dir or cfg.base_run_dir
    assert root is not None
    path = root / run_config.tokenizer  # an absolute tokenizer path stays as it is
    if path.is_file():
        check_corpus_tokenizer(cfg.data_dir, path)


def load_base_weights(cfg: SFTConfig, model: MorphTransformer) -> Path:
    """Load the base into ``model``; returns the checkpoint file or HF directory it came from."""
    if cfg.base_hf_dir is None:
        assert cfg.base_run_dir is not None
        path, state = read_base_weights(cfg.base_run_dir, cfg.base_checkpoint)
        model.load_state_dict(state)
        return path
    model.load_state_dict(load_hf_base(cfg.base_hf_dir, cfg.base_morph_expert_dim).state_dict())
    return cfg.base_hf_dir


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
    return _write_base_run(Path(out_dir), model, RunConfig(model=cfg.to_dict(), eos_id=eos_id))


def import_hf_base(hf_dir: Path, out_dir: Path, *, morph_expert_dim: int = 0) -> Path:
    """Write a base run from a Hugging Face directory, all at once (``out_dir`` must not exist).

    The run holds the imported model grown for its tokenizer's control ids (and morph experts
    when ``morph_expert_dim`` > 0) and a copy of the tokenizer files, so SFT can check that a
    corpus was prepared with the same tokenizer.

    Raises:
        FileExistsError: ``out_dir`` exists.
        HFImportError, TokenizerError: the checkpoint or its tokenizer cannot be read.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; choose a new --out directory")
    model = load_hf_base(hf_dir, morph_expert_dim)
    tokenizer = load_tokenizer(hf_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        (tmp / BASE_TOKENIZER_DIR).mkdir(parents=True)
        copy_tokenizer_files(tokenizer, tmp / BASE_TOKENIZER_DIR)
        run_config = RunConfig(
            model=model.cfg.to_dict(),
            eos_id=tokenizer.eos_id,
            tokenizer=f"{BASE_TOKENIZER_DIR}/{tokenizer.name}",
        )
        checkpoint = _write_base_run(tmp, model, run_config)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir / checkpoint.relative_to(tmp)


def _write_base_run(out_dir: Path, model: MorphTransformer, run_config: RunConfig) -> Path:
    text = msgspec.yaml.encode(run_config)
    atomic_write_bytes(out_dir / BASE_CONFIG_FILE, text)
    payload = {"model": model.state_dict(), "step": 0, "model_config": model.cfg.to_dict()}
    return save_checkpoint(out_dir, 0, payload, keep_last=1, keep_every=0)
