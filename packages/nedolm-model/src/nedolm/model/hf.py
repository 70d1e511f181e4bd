"""Weight export for use outside the trainer, and loading it back.

A dense model (`n_morph_classes == 0`) is written in Hugging Face Llama format (`config.json` +
`model.safetensors`, tied or untied as the model is, llama3 rope scaling kept), so
`transformers.LlamaForCausalLM.from_pretrained(out_dir)` gives the same logits. Only the logical
vocabulary rows are exported, so HF sees `vocab_size` exactly. Llama has no morph experts, so a
morph model is written as `architectures: [NedoLMForCausalLM]` with Llama's tensor names plus its
morph tensors (the class buffer included) and its loader code (`configuration_nedolm.py`,
`modeling_nedolm.py` from `nedolm.model.hf_remote`, named in `auto_map`):
`AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True)` gives the same logits.
Its `model_type` is `llama` all the same: transformers 5 reads config.json in every
`AutoTokenizer.from_pretrained`, and an unknown model_type there means a trust_remote_code prompt
and a model-type warning for loading a tokenizer; a `hidden_act` only the NedoLM code accepts
keeps a plain Llama from loading the weights without their experts (see `MORPH_HIDDEN_ACT`).
`load_hf` reads both, and the `nedolm` and `nedolm_morph` formats morph exports used before.
Tokenizer files are the caller's; `token_ids` puts the tokenizer's ids into config.json.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import as_file, files
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nedolm.model.config import ModelConfig, ModelConfigError
from nedolm.model.hf_import import (
    CONFIG_NAME,
    MORPH_CLASSES,
    MORPH_HIDDEN_ACT,
    MORPH_MODEL_TYPE,
    NEDOLM_ARCHITECTURE,
    WEIGHTS_NAME,
    HFImportError,
    import_hf,
    to_llama_state,
)
from nedolm.model.hf_remote import REMOTE_CODE_FILES
from nedolm.model.model import MorphTransformer, build_model

LEGACY_MORPH_MODEL_TYPE = "nedolm_morph"  # our own parameter names, no loader code


class ExportFormatError(HFImportError):
    """An export directory is missing a file, or holds a config or weights we cannot read."""


@dataclass(frozen=True)
class TokenIds:
    """The ids of the tokenizer shipped beside an export, as config.json names them
    (`eos_token_id`, `bos_token_id`, `pad_token_id`): generation and collators read them there."""

    eos: int
    pad: int
    bos: int | None = None


def export_hf(
    model: MorphTransformer,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    token_ids: TokenIds | None = None,
) -> Path:
    """Write `model` to `out_dir` (created if needed); each file appears atomically.

    Args:
        model: the (uncompiled) model.
        out_dir: target directory; existing files of other names are left alone.
        dtype: cast the weights (e.g. torch.bfloat16); default keeps the model's dtype.
        token_ids: the ids of the tokenizer written beside it; without, config.json names none.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    state = to_llama_state({k: v.detach() for k, v in model.state_dict().items()}, cfg)
    config = _nedolm_config(cfg) if cfg.n_morph_classes else _llama_config(cfg)
    config.update(_token_fields(token_ids))
    if dtype is not None:
        state = {k: v if k == MORPH_CLASSES else v.to(dtype) for k, v in state.items()}
    state = {k: v.contiguous().cpu() for k, v in state.items()}
    config["torch_dtype"] = str(state["model.norm.weight"].dtype).removeprefix("torch.")
    if cfg.n_morph_classes:
        for name in REMOTE_CODE_FILES:
            with as_file(files("nedolm.model.hf_remote") / name) as source:
                _atomic_write(out / name, lambda tmp, source=source: shutil.copyfile(source, tmp))
    _atomic_write(out / WEIGHTS_NAME, lambda tmp: save_file(state, str(tmp), {"format": "pt"}))
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    _atomic_write(out / CONFIG_NAME, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return out


def load_hf(out_dir: str | Path, **overrides: object) -> MorphTransformer:
    """Load a directory written by `export_hf` (either morph format), or any Llama/Mistral
    checkpoint `import_hf` reads.

    Args:
        out_dir: directory with config.json and model.safetensors.
        overrides: ModelConfig fields to change, e.g. attn_impl="sdpa" or max_seq_len.

    Raises:
        HFImportError: missing file, unsupported config, or weights that do not match
            (ExportFormatError for the legacy `nedolm_morph` format).
    """
    root = Path(out_dir)
    config_path, weights_path = root / CONFIG_NAME, root / WEIGHTS_NAME
    if not config_path.is_file():
        raise ExportFormatError(f"{config_path}: missing")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if config.get("model_type") != LEGACY_MORPH_MODEL_TYPE:
            return import_hf(root, **overrides)
        cfg = ModelConfig(**{**config["nedolm_config"], **overrides})
    except (json.JSONDecodeError, KeyError, TypeError, ModelConfigError) as err:
        raise ExportFormatError(f"{config_path}: {err}") from err
    if not weights_path.is_file():
        raise ExportFormatError(f"{weights_path}: missing")
    state = load_file(str(weights_path))
    model = build_model(cfg, init_weights=False)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ExportFormatError(f"{weights_path}: {err}") from err
    return model


def _llama_config(cfg: ModelConfig) -> dict[str, object]:
    return {
        **hf_config_fields(cfg),
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rope_theta": cfg.rope_theta,  # transformers < 5
        "rope_scaling": cfg.rope_scaling,  # transformers < 5
        "attention_bias": False,
        "mlp_bias": False,
    }


def _nedolm_config(cfg: ModelConfig) -> dict[str, object]:
    return {
        **hf_config_fields(cfg),
        "architectures": [NEDOLM_ARCHITECTURE],
        "model_type": MORPH_MODEL_TYPE,
        "hidden_act": MORPH_HIDDEN_ACT,
        "auto_map": {
            "AutoConfig": "configuration_nedolm.NedoLMConfig",
            "AutoModelForCausalLM": "modeling_nedolm.NedoLMForCausalLM",
        },
        "num_morph_classes": cfg.n_morph_classes,
        "morph_expert_size": cfg.morph_expert_dim,
    }


def hf_config_fields(cfg: ModelConfig) -> dict[str, object]:
    """The config.json fields Llama and NedoLM exports share (transformers' names): with them,
    ``transformers.LlamaConfig(**hf_config_fields(cfg))`` is the dense model of ``cfg``."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}
        | (cfg.rope_scaling or {}),
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def _token_fields(ids: TokenIds | None) -> dict[str, int | None]:
    """config.json's token ids: the shipped tokenizer's, or none when no tokenizer goes along."""
    if ids is None:
        return {"eos_token_id": None, "bos_token_id": None, "pad_token_id": None}
    return {"eos_token_id": ids.eos, "bos_token_id": ids.bos, "pad_token_id": ids.pad}


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
