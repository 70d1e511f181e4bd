"""Weight export for use outside the trainer, and loading it back.

A dense model (`n_morph_classes == 0`) is written in Hugging Face Llama format (`config.json` +
`model.safetensors`, tied or untied as the model is, llama3 rope scaling kept), so `transformers.LlamaForCausalLM.from_pretrained(out_dir)` gives the
same logits. Only the logical vocabulary rows are exported, so HF sees `vocab_size` exactly.
Llama has no morph experts, so a morph model is written in our own format instead: the same two
file names, with `config.json` = {"model_type": "nedolm_morph", "nedolm_config": {...}} and our
parameter names; load it with `nedolm.model.load_hf(out_dir)`. Tokenizer files are the caller's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nedolm.model.config import ModelConfig, ModelConfigError
from nedolm.model.hf_import import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HFImportError,
    import_hf,
    to_llama_state,
)
from nedolm.model.model import MorphTransformer, build_model

MORPH_MODEL_TYPE = "nedolm_morph"


class ExportFormatError(HFImportError):
    """An export directory is missing a file, or holds a config or weights we cannot read."""


def export_hf(
    model: MorphTransformer, out_dir: str | Path, *, dtype: torch.dtype | None = None
) -> Path:
    """Write `model` to `out_dir` (created if needed); each file appears atomically.

    Args:
        model: the (uncompiled) model.
        out_dir: target directory; existing files of other names are left alone.
        dtype: cast the weights (e.g. torch.bfloat16); default keeps the model's dtype.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if cfg.n_morph_classes:
        config = {
            "model_type": MORPH_MODEL_TYPE,
            "format_version": 1,
            "nedolm_config": cfg.to_dict(),
        }
    else:
        config, state = _llama_config(cfg), to_llama_state(state, cfg)
    if dtype is not None:
        state = {k: v if k == "morph_classes" else v.to(dtype) for k, v in state.items()}
    state = {k: v.contiguous().cpu() for k, v in state.items()}
    config["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    _atomic_write(out / WEIGHTS_NAME, lambda tmp: save_file(state, str(tmp), {"format": "pt"}))
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    _atomic_write(out / CONFIG_NAME, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return out


def load_hf(out_dir: str | Path, **overrides: object) -> MorphTransformer:
    """Load a directory written by `export_hf`, or any Llama/Mistral checkpoint `import_hf` reads.

    Args:
        out_dir: directory with config.json and model.safetensors.
        overrides: ModelConfig fields to change, e.g. attn_impl="sdpa" or max_seq_len.

    Raises:
        HFImportError: missing file, unsupported config, or weights that do not match
            (ExportFormatError for our own morph format).
    """
    root = Path(out_dir)
    config_path, weights_path = root / CONFIG_NAME, root / WEIGHTS_NAME
    if not config_path.is_file():
        raise ExportFormatError(f"{config_path}: missing")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if config.get("model_type") != MORPH_MODEL_TYPE:
            return import_hf(root, **overrides)
        cfg = ModelConfig(**{**config["nedolm_config"], **overrides})
    except (json.JSONDecodeError, KeyError, TypeError, ModelConfigError) as err:
        raise ExportFormatError(f"{config_path}: {err}") from err
    if not weights_path.is_file():
        raise ExportFormatError(f"{weights_path}: missing")
    state = load_file(str(weights_path))
    model = build_model(cfg)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ExportFormatError(f"{weights_path}: {err}") from err
    return model


def _llama_config(cfg: ModelConfig) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers < 5
        "rope_scaling": cfg.rope_scaling,  # transformers < 5
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}
        | (cfg.rope_scaling or {}),
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None,  # token ids belong to the tokenizer the app ships alongside
        "eos_token_id": None,
        "pad_token_id": None,
    }


def _atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates 0600 files; exports are shared
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
