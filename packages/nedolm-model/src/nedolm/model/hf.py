"""Weight export for use outside the trainer, and loading it back.

A dense model (`n_morph_classes == 0`) is written in Hugging Face Llama format (`config.json` +
`model.safetensors`), so `transformers.LlamaForCausalLM.from_pretrained(out_dir)` gives the
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
from torch import Tensor

from nedolm.model.config import ModelConfig, ModelConfigError
from nedolm.model.model import MorphTransformer, build_model

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
MORPH_MODEL_TYPE = "nedolm_morph"


class ExportFormatError(ValueError):
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
        config, state = _llama_config(cfg), _to_llama(state, cfg)
    if dtype is not None:
        state = {k: v if k == "morph_classes" else v.to(dtype) for k, v in state.items()}
    state = {k: v.contiguous().cpu() for k, v in state.items()}
    config["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    _atomic_write(out / WEIGHTS_NAME, lambda tmp: save_file(state, str(tmp), {"format": "pt"}))
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    _atomic_write(out / CONFIG_NAME, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return out


def load_hf(out_dir: str | Path, **overrides: object) -> MorphTransformer:
    """Load a directory written by `export_hf` (or any Llama checkpoint of supported shape).

    Args:
        out_dir: directory with config.json and model.safetensors.
        overrides: ModelConfig fields to change, e.g. attn_impl="sdpa" or max_seq_len.

    Raises:
        ExportFormatError: missing file, unknown model_type, or weights that do not match.
    """
    root = Path(out_dir)
    config_path, weights_path = root / CONFIG_NAME, root / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            raise ExportFormatError(f"{path}: missing")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        model_type = config.get("model_type")
        if model_type == MORPH_MODEL_TYPE:
            cfg = ModelConfig(**{**config["nedolm_config"], **overrides})
        elif model_type == "llama":
            cfg = _from_llama_config(config, overrides)
        else:
            raise ExportFormatError(f"{config_path}: unsupported model_type {model_type!r}")
    except (json.JSONDecodeError, KeyError, TypeError, ModelConfigError) as err:
        raise ExportFormatError(f"{config_path}: {err}") from err
    state = load_file(str(weights_path))
    if model_type == "llama":
        state = _from_llama(state, cfg, weights_path)
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
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None,  # token ids belong to the tokenizer the app ships alongside
        "eos_token_id": None,
        "pad_token_id": None,
    }


def _from_llama_config(config: dict, overrides: dict[str, object]) -> ModelConfig:
    if config.get("tie_word_embeddings") is False:
        raise ExportFormatError("untied Llama embeddings are not supported (NedoLM ties them)")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ExportFormatError(f"rope_type {rope['rope_type']!r} is not supported")
    fields = dict(
        vocab_size=config["vocab_size"],
        d_model=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=config["num_attention_heads"],
        n_kv_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
        ffn_dim=config["intermediate_size"],
        max_seq_len=config["max_position_embeddings"],
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        norm_eps=config["rms_norm_eps"],
        init_std=config.get("initializer_range", 0.02),
    )
    return ModelConfig(**{**fields, **overrides})


def _llama_names(layer: int) -> dict[str, str]:
    prefix, ours = f"model.layers.{layer}.", f"blocks.{layer}."
    return {
        ours + "attn_norm.weight": prefix + "input_layernorm.weight",
        ours + "attn.wo.weight": prefix + "self_attn.o_proj.weight",
        ours + "ffn_norm.weight": prefix + "post_attention_layernorm.weight",
        ours + "ffn.w_down.weight": prefix + "mlp.down_proj.weight",
    }


def _fused_parts(cfg: ModelConfig, layer: int) -> dict[str, tuple[list[str], list[int]]]:
    """Our fused weights and the Llama weights they stack, with their row counts."""
    prefix, ours = f"model.layers.{layer}.", f"blocks.{layer}."
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attn = [prefix + f"self_attn.{p}_proj.weight" for p in "qkv"]
    mlp = [prefix + f"mlp.{p}_proj.weight" for p in ("gate", "up")]
    return {
        ours + "attn.wqkv.weight": (attn, [q, kv, kv]),
        ours + "ffn.w_gate_up.weight": (mlp, [cfg.ffn_dim, cfg.ffn_dim]),
    }


def _to_llama(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    out = {
        "model.embed_tokens.weight": state["tok_embeddings.weight"][: cfg.vocab_size],
        "model.norm.weight": state["norm.weight"],
    }
    for layer in range(cfg.n_layers):
        out.update({hf: state[ours] for ours, hf in _llama_names(layer).items()})
        for ours, (names, rows) in _fused_parts(cfg, layer).items():
            out.update(zip(names, state[ours].split(rows), strict=True))
    return out


def _from_llama(state: dict[str, Tensor], cfg: ModelConfig, path: Path) -> dict[str, Tensor]:
    def take(name: str) -> Tensor:
        if name not in state:
            raise ExportFormatError(f"{path}: missing tensor {name!r}")
        return state[name]

    embed = take("model.embed_tokens.weight")
    padded = embed.new_zeros(cfg.padded_vocab_size, cfg.d_model)
    padded[: embed.size(0)] = embed
    out = {"tok_embeddings.weight": padded, "norm.weight": take("model.norm.weight")}
    for layer in range(cfg.n_layers):
        out.update({ours: take(hf) for ours, hf in _llama_names(layer).items()})
        for ours, (names, _) in _fused_parts(cfg, layer).items():
            out[ours] = torch.cat([take(name) for name in names])
    return out


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
