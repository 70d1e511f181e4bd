"""NedoLM model configuration for transformers (``architectures: [NedoLMForCausalLM]``).

Llama's field names, plus the morph experts: every block adds one SwiGLU expert of width
``morph_expert_size`` per morph class, chosen by the class of the token's input id. Rotary
settings live in ``rope_parameters`` ({"rope_type": "default" or "llama3", "rope_theta", ...}),
the one spelling transformers 4 leaves alone and transformers 5 understands. The model_type is
``llama`` so that transformers reads config.json without remote code where it only needs the
tokenizer; ``hidden_act`` (which Llama's MLP would look up) is not read here.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class NedoLMConfig(PretrainedConfig):
    """Architecture of a NedoLM MorphTransformer, as written by ``nedolm-sft export``."""

    model_type = "llama"  # config.json's; from_pretrained warns when the two differ

    def __init__(
        self,
        vocab_size: int = 32003,
        hidden_size: int = 256,
        intermediate_size: int = 704,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        head_dim: int | None = None,
        num_morph_classes: int = 3,
        morph_expert_size: int = 64,
        max_position_embeddings: int = 1024,
        rms_norm_eps: float = 1e-5,
        rope_parameters: dict[str, Any] | None = None,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        tie_word_embeddings: bool = True,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.num_morph_classes = num_morph_classes
        self.morph_expert_size = morph_expert_size
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_parameters = rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
