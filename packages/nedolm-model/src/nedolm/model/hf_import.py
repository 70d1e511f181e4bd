"""Read a Hugging Face Llama/Mistral checkpoint directory (or a NedoLM morph export) into a
MorphTransformer.

Reads `config.json` and `model.safetensors` (or a sharded `model.safetensors.index.json`) with
`safetensors` alone; `transformers` is never imported. Every architecture switch that our model
does not implement (biases, sliding-window attention, rotary scalings other than `llama3`,
activations other than SiLU, ...) is refused with one line naming the config field and its
value, rather than imported into a model that would compute something else. Names, shapes and
the set of tensors are checked against the config before any weight is read. The mapping
between Llama tensor names and ours lives here and is shared with `nedolm.model.hf` (export).
A NedoLM morph export (`architectures: [NedoLMForCausalLM]`; `model_type` is `llama`, or
`nedolm` in older exports) uses the same names plus its morph tensors (`model.morph_classes`,
`model.layers.N.morph.{gate,up,down}_proj.weight`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from nedolm.model.config import LLAMA3_ROPE_KEYS, ModelConfig, ModelConfigError
from nedolm.model.model import MorphTransformer, build_model

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
NEDOLM_MODEL_TYPE = "nedolm"  # what morph exports were written as before MORPH_MODEL_TYPE
NEDOLM_ARCHITECTURE = "NedoLMForCausalLM"
MORPH_MODEL_TYPE = "llama"
"""A morph export's model_type: one transformers knows, so that reading its config (as
`AutoTokenizer.from_pretrained` always does) asks for no remote code; its architecture and
`auto_map` still name the NedoLM classes."""
MORPH_HIDDEN_ACT = "silu with NedoLM morph experts: load with trust_remote_code=True"
"""A morph export's hidden_act: Llama's MLP looks it up and fails with this message, so a Llama
never loads a morph export without its experts; the NedoLM loader code does not read it."""
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    NEDOLM_ARCHITECTURE: NEDOLM_MODEL_TYPE,
}
MODEL_TYPES = ("llama", "mistral", NEDOLM_MODEL_TYPE)
# Config fields that must hold exactly this value (a missing field means the same in
# transformers): anything else changes the function the checkpoint computes.
_REQUIRED_VALUES: dict[str, object] = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "sliding_window": None,
    "use_sliding_window": False,
    "quantization_config": None,
    "partial_rotary_factor": 1.0,
}
_IGNORED_TENSOR_SUFFIX = "rotary_emb.inv_freq"  # a buffer some old checkpoints saved
MORPH_CLASSES = "model.morph_classes"  # int64 [vocab]: the morph class of each input id


class HFImportError(ValueError):
    """A Hugging Face directory we cannot import; the message names the file, tensor or field."""


def import_hf(hf_dir: str | Path, **overrides: Any) -> MorphTransformer:
    """A MorphTransformer computing what the checkpoint in `hf_dir` computes (dense for
    Llama/Mistral, with its morph experts for a NedoLM export).

    Args:
        hf_dir: directory with config.json and model.safetensors or model.safetensors.index.json.
        overrides: ModelConfig fields to change, e.g. attn_impl="sdpa" or max_seq_len=4096.

    Raises:
        HFImportError: a missing file, an unsupported config field, or tensors that do not match.
    """
    cfg = read_hf_config(hf_dir, **overrides)
    model = build_model(cfg)
    model.load_state_dict(read_hf_state(hf_dir, cfg))
    return model


def read_hf_config(hf_dir: str | Path, **overrides: Any) -> ModelConfig:
    """The ModelConfig of the Llama/Mistral `config.json` in `hf_dir` (refusing what we lack)."""
    path = Path(hf_dir) / CONFIG_NAME
    if not path.is_file():
        raise HFImportError(f"{path}: missing")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HFImportError(f"{path}: not readable JSON: {err}") from err
    if not isinstance(config, dict):
        raise HFImportError(f"{path}: expected a JSON object")
    try:
        return ModelConfig(**{**_model_fields(config), **overrides})
    except KeyError as err:
        raise HFImportError(f"{path}: missing field {err.args[0]!r}") from err
    except (ModelConfigError, _Unsupported) as err:
        raise HFImportError(f"{path}: {err}") from err


class _Unsupported(ValueError):
    pass


def _model_fields(config: dict[str, Any]) -> dict[str, Any]:
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise _Unsupported(
            f"unsupported model_type {model_type!r} (supported: {', '.join(MODEL_TYPES)})"
        )
    architectures = config.get("architectures") or [
        name for name, kind in ARCHITECTURES.items() if kind == model_type
    ]
    if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
        raise _Unsupported(
            f"unsupported architectures {architectures!r} (supported: {sorted(ARCHITECTURES)})"
        )
    required = dict(_REQUIRED_VALUES)
    if architectures[0] == NEDOLM_ARCHITECTURE and config.get("hidden_act") == MORPH_HIDDEN_ACT:
        del required["hidden_act"]
    for field, wanted in required.items():
        value = config.get(field, wanted)
        if value != wanted:
            raise _Unsupported(f"unsupported {field} {value!r} (NedoLM needs {wanted!r})")
    n_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    if head_dim * n_heads != config["hidden_size"]:
        raise _Unsupported(
            f"unsupported head_dim {head_dim!r} (NedoLM needs hidden_size / num_attention_heads)"
        )
    rope_theta, rope_scaling = _rope(config)
    return dict(
        vocab_size=config["vocab_size"],
        d_model=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        ffn_dim=config["intermediate_size"],
        n_morph_classes=config.get("num_morph_classes", 0),
        morph_expert_dim=config.get("morph_expert_size", 0),
        max_seq_len=config["max_position_embeddings"],
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        norm_eps=config["rms_norm_eps"],
        init_std=config.get("initializer_range", 0.02),
        # transformers' Llama and Mistral configs default to untied embeddings.
        tie_embeddings=config.get("tie_word_embeddings", False),
    )


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and llama3 scaling, from transformers 5 `rope_parameters` or 4.x fields."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        field = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
        raise _Unsupported(f"unsupported {field} rope_type {rope_type!r} (default or llama3)")
    return theta, {"rope_type": "llama3", **{k: params.get(k) for k in LLAMA3_ROPE_KEYS}}


def read_hf_state(hf_dir: str | Path, cfg: ModelConfig) -> dict[str, Tensor]:
    """Our state dict from the checkpoint's safetensors files, checked against `cfg` first."""
    files, listing = _weight_files(Path(hf_dir))
    expected = llama_shapes(cfg)
    # A tied checkpoint may still carry lm_head.weight; it must then equal the embedding.
    allowed = {**expected, "lm_head.weight": expected["model.embed_tokens.weight"]}
    located: dict[str, Path] = {}
    for path, listed in files.items():
        with _open(path) as handle:
            present = set(handle.keys())
            for name in listed or sorted(present):
                if name not in present:
                    raise HFImportError(f"{path}: missing tensor {name!r} (listed in {INDEX_NAME})")
                if name.endswith(_IGNORED_TENSOR_SUFFIX):
                    continue
                if name not in allowed:
                    raise HFImportError(f"{path}: unexpected tensor {name!r} for {CONFIG_NAME}")
                shape = list(handle.get_slice(name).get_shape())
                if shape != allowed[name]:
                    raise HFImportError(
                        f"{path}: tensor {name!r} has shape {shape}, {CONFIG_NAME} implies "
                        f"{allowed[name]}"
                    )
                located[name] = path
    missing = sorted(set(expected) - set(located))
    if missing:
        raise HFImportError(f"{listing}: missing tensor {missing[0]!r}")
    tensors: dict[str, Tensor] = {}
    for path in dict.fromkeys(located.values()):
        with _open(path) as handle:
            tensors.update({n: handle.get_tensor(n) for n, p in located.items() if p == path})
    tied_head = tensors.pop("lm_head.weight", None) if cfg.tie_embeddings else None
    if tied_head is not None and not torch.equal(tied_head, tensors["model.embed_tokens.weight"]):
        raise HFImportError(
            f"{located['lm_head.weight']}: tensor 'lm_head.weight' differs from "
            "'model.embed_tokens.weight' but tie_word_embeddings is true"
        )
    classes = tensors.get(MORPH_CLASSES)
    if classes is not None and (
        classes.is_floating_point() or not ((classes >= 0) & (classes < cfg.n_morph_classes)).all()
    ):
        raise HFImportError(
            f"{located[MORPH_CLASSES]}: tensor {MORPH_CLASSES!r} must hold integer morph classes "
            f"in [0, {cfg.n_morph_classes})"
        )
    return from_llama_state(tensors, cfg)


def _weight_files(root: Path) -> tuple[dict[Path, list[str]], Path]:
    """Each weights file with the tensor names the index assigns to it ([] when unsharded)."""
    index_path, single = root / INDEX_NAME, root / WEIGHTS_NAME
    if not index_path.is_file():
        if not single.is_file():
            raise HFImportError(f"{root}: no {WEIGHTS_NAME} or {INDEX_NAME}")
        return {single: []}, single
    files: dict[Path, list[str]] = {}
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        for name, file in weight_map.items():
            files.setdefault(root / file, []).append(name)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise HFImportError(f"{index_path}: not a safetensors index: {err!r}") from err
    for path in files:
        if not path.is_file():
            raise HFImportError(f"{path}: missing (listed in {INDEX_NAME})")
    return files, index_path


def _open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except Exception as err:  # safetensors raises its own SafetensorError for bad headers
        raise HFImportError(f"{path}: not a readable safetensors file: {err}") from err


def llama_shapes(cfg: ModelConfig) -> dict[str, list[int]]:
    """Every Hugging Face tensor name of `cfg` with its shape (Llama's, plus morph tensors)."""
    D, F, V = cfg.d_model, cfg.ffn_dim, cfg.vocab_size
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": [V, D], "model.norm.weight": [D]}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = [V, D]
    experts = cfg.n_morph_classes * cfg.morph_expert_dim
    if experts:
        shapes[MORPH_CLASSES] = [V]
    for layer in range(cfg.n_layers):
        p = f"model.layers.{layer}."
        shapes.update(
            {
                p + "input_layernorm.weight": [D],
                p + "post_attention_layernorm.weight": [D],
                p + "self_attn.q_proj.weight": [q, D],
                p + "self_attn.k_proj.weight": [kv, D],
                p + "self_attn.v_proj.weight": [kv, D],
                p + "self_attn.o_proj.weight": [D, q],
                p + "mlp.gate_proj.weight": [F, D],
                p + "mlp.up_proj.weight": [F, D],
                p + "mlp.down_proj.weight": [D, F],
            }
        )
        if experts:
            shapes.update(
                {
                    p + "morph.gate_proj.weight": [experts, D],
                    p + "morph.up_proj.weight": [experts, D],
                    p + "morph.down_proj.weight": [D, experts],
                }
            )
    return shapes


def _llama_names(cfg: ModelConfig, layer: int) -> dict[str, str]:
    prefix, ours = f"model.layers.{layer}.", f"blocks.{layer}."
    names = {
        ours + "attn_norm.weight": prefix + "input_layernorm.weight",
        ours + "attn.wo.weight": prefix + "self_attn.o_proj.weight",
        ours + "ffn_norm.weight": prefix + "post_attention_layernorm.weight",
        ours + "ffn.w_down.weight": prefix + "mlp.down_proj.weight",
    }
    if cfg.n_morph_classes:
        names.update(
            {
                ours + "morph.w_gate": prefix + "morph.gate_proj.weight",
                ours + "morph.w_up": prefix + "morph.up_proj.weight",
                ours + "morph.w_down": prefix + "morph.down_proj.weight",
            }
        )
    return names


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


def to_llama_state(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Hugging Face tensors of our state dict (logical vocabulary rows only)."""
    out = {
        "model.embed_tokens.weight": state["tok_embeddings.weight"][: cfg.vocab_size],
        "model.norm.weight": state["norm.weight"],
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["output.weight"][: cfg.vocab_size]
    if cfg.n_morph_classes:
        out[MORPH_CLASSES] = state["morph_classes"][: cfg.vocab_size]
    for layer in range(cfg.n_layers):
        out.update({hf: state[ours] for ours, hf in _llama_names(cfg, layer).items()})
        for ours, (names, rows) in _fused_parts(cfg, layer).items():
            out.update(zip(names, state[ours].split(rows), strict=True))
    return out


def from_llama_state(tensors: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Our state dict of checked Hugging Face tensors (vocabulary rows padded with zeros, and
    padding ids in the last morph class, as `MorphTransformer.set_morph_classes` leaves them)."""
    out = {
        "tok_embeddings.weight": _pad_rows(tensors["model.embed_tokens.weight"], cfg),
        "norm.weight": tensors["model.norm.weight"],
    }
    if not cfg.tie_embeddings:
        out["output.weight"] = _pad_rows(tensors["lm_head.weight"], cfg)
    if cfg.n_morph_classes:
        classes = tensors[MORPH_CLASSES]
        out["morph_classes"] = classes.new_full((cfg.padded_vocab_size,), cfg.n_morph_classes - 1)
        out["morph_classes"][: cfg.vocab_size] = classes
    for layer in range(cfg.n_layers):
        out.update({ours: tensors[hf] for ours, hf in _llama_names(cfg, layer).items()})
        for ours, (names, _) in _fused_parts(cfg, layer).items():
            out[ours] = torch.cat([tensors[name] for name in names])
    return out


def _pad_rows(weight_VD: Tensor, cfg: ModelConfig) -> Tensor:
    padded = weight_VD.new_zeros(cfg.padded_vocab_size, cfg.d_model)
    padded[: weight_VD.size(0)] = weight_VD
    return padded
