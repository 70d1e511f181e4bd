"""NedoLM MorphTransformer: packed varlen attention, morph routing, fused assistant-only loss."""

from nedolm.model.attention import AttentionBackendError, attention_backends, resolve_attn_impl
from nedolm.model.config import ModelConfig, ModelConfigError, preset, preset_names
from nedolm.model.generate import KVCache, generate
from nedolm.model.hf import ExportFormatError, export_hf, load_hf
from nedolm.model.layout import packed_layout
from nedolm.model.loss import IGNORE_INDEX, fused_linear_cross_entropy
from nedolm.model.model import MorphTransformer, build_model
from nedolm.model.morph import morph_classes_from_vocab

__all__ = [
    "IGNORE_INDEX",
    "AttentionBackendError",
    "ExportFormatError",
    "KVCache",
    "ModelConfig",
    "ModelConfigError",
    "MorphTransformer",
    "attention_backends",
    "build_model",
    "export_hf",
    "fused_linear_cross_entropy",
    "generate",
    "load_hf",
    "morph_classes_from_vocab",
    "packed_layout",
    "preset",
    "preset_names",
    "resolve_attn_impl",
]
