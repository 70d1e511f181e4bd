"""NedoLM MorphTransformer: packed varlen attention, morph routing, fused assistant-only loss."""

from nedolm.model.attention import AttentionBackendError, attention_backends, varlen_gqa_mode
from nedolm.model.attn_select import probe_backends, resolve_attn_impl
from nedolm.model.config import ModelConfig, ModelConfigError, preset, preset_names
from nedolm.model.extend import add_morph_experts, grow_vocab
from nedolm.model.generate import KVCache, generate
from nedolm.model.hf import ExportFormatError, export_hf, hf_config_fields, load_hf
from nedolm.model.hf_import import HFImportError, import_hf, read_hf_config
from nedolm.model.layout import host_to_device, packed_layout
from nedolm.model.loss import IGNORE_INDEX, fused_linear_cross_entropy
from nedolm.model.model import MorphTransformer, build_model
from nedolm.model.morph import morph_classes_from_vocab

__all__ = [
    "IGNORE_INDEX",
    "AttentionBackendError",
    "ExportFormatError",
    "HFImportError",
    "KVCache",
    "ModelConfig",
    "ModelConfigError",
    "MorphTransformer",
    "add_morph_experts",
    "attention_backends",
    "build_model",
    "export_hf",
    "fused_linear_cross_entropy",
    "generate",
    "grow_vocab",
    "hf_config_fields",
    "host_to_device",
    "import_hf",
    "load_hf",
    "morph_classes_from_vocab",
    "packed_layout",
    "preset",
    "preset_names",
    "probe_backends",
    "read_hf_config",
    "resolve_attn_impl",
    "varlen_gqa_mode",
]
