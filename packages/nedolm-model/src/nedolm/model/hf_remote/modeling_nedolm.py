"""NedoLM (MorphTransformer) as a transformers causal LM: logits, loss, KV-cached ``generate()``.

A Llama decoder (pre-norm RMSNorm, rotary q/k, grouped-query attention, SwiGLU, no biases) whose
blocks add one small SwiGLU expert per morph class to the shared feed-forward: a token goes
through the expert of its input id's class, looked up in the ``morph_classes`` buffer that
travels with the weights. Written for transformers on its own (it imports torch and
transformers only), so comparing its logits with NedoLM's own model checks both.

Load an export with
``AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True)``.
"""

# Shape legend: B batch, S new tokens, L cached + new tokens, D model dim, H query heads,
# G kv heads, K head dim, C morph classes, E expert dim, V vocab.
from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_nedolm import NedoLMConfig

# transformers 5.2x renamed the cache argument and output field `past_key_values` to `cache`.
_CACHE_FIELD = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
)


class NedoLMRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()  # bf16 sums of squares lose digits
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotary_inv_freq(config: NedoLMConfig) -> Tensor:
    """Float64 inverse frequencies [K/2], with Llama 3.1's scaling when rope_type is llama3."""
    params, dim = config.rope_parameters, config.head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if params.get("rope_type", "default") == "default":
        return inv_freq
    if params["rope_type"] != "llama3":
        raise ValueError(
            f"NedoLM supports rope_type default or llama3, got {params['rope_type']!r}"
        )
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    long = inv_freq / factor
    blend = (old_context / wavelen - low) / (high - low)
    medium = (1 - blend) * long + blend * inv_freq
    out = torch.where(wavelen > old_context / low, long, inv_freq)
    return torch.where(
        (wavelen >= old_context / high) & (wavelen <= old_context / low), medium, out
    )


def rotate(x_BHSK: Tensor, cos_BSK: Tensor, sin_BSK: Tensor) -> Tensor:
    """Half-rotation rotary embedding, computed in float32."""
    x = x_BHSK.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos_BSK[:, None] + rotated * sin_BSK[:, None]).to(x_BHSK.dtype)


class NedoLMAttention(nn.Module):
    def __init__(self, config: NedoLMConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        D, K = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(D, self.n_heads * K, bias=False)
        self.k_proj = nn.Linear(D, self.n_kv_heads * K, bias=False)
        self.v_proj = nn.Linear(D, self.n_kv_heads * K, bias=False)
        self.o_proj = nn.Linear(self.n_heads * K, D, bias=False)

    def forward(
        self,
        x_BSD: Tensor,
        rope: tuple[Tensor, Tensor],
        allowed_B1SL: Tensor,
        cache: Cache | None,
    ) -> Tensor:
        B, S, _ = x_BSD.shape
        q_BHSK = self.q_proj(x_BSD).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        k_BGSK = self.k_proj(x_BSD).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v_BGSK = self.v_proj(x_BSD).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q_BHSK, k_BGSK = rotate(q_BHSK, *rope), rotate(k_BGSK, *rope)
        if cache is not None:
            k_BGSK, v_BGSK = cache.update(k_BGSK, v_BGSK, self.layer_idx)
        groups = self.n_heads // self.n_kv_heads
        k_BHLK = k_BGSK.repeat_interleave(groups, dim=1)
        v_BHLK = v_BGSK.repeat_interleave(groups, dim=1)
        out_BHSK = F.scaled_dot_product_attention(q_BHSK, k_BHLK, v_BHLK, attn_mask=allowed_B1SL)
        return self.o_proj(out_BHSK.transpose(1, 2).reshape(B, S, -1))


class NedoLMMLP(nn.Module):
    """SwiGLU; the shared path of every block."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class NedoLMMorphExperts(nn.Module):
    """One SwiGLU expert per morph class; rows c*E:(c+1)*E of gate/up (columns of down) are c's."""

    def __init__(self, config: NedoLMConfig) -> None:
        super().__init__()
        self.n_classes, self.expert_size = config.num_morph_classes, config.morph_expert_size
        width = self.n_classes * self.expert_size
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)

    def forward(self, x_BSD: Tensor, route_BSC: Tensor) -> Tensor:
        B, S, _ = x_BSD.shape
        hidden = F.silu(self.gate_proj(x_BSD)) * self.up_proj(x_BSD)
        chosen_BSCE = hidden.view(B, S, self.n_classes, self.expert_size) * route_BSC[..., None]
        return self.down_proj(chosen_BSCE.view(B, S, -1))


class NedoLMDecoderLayer(nn.Module):
    def __init__(self, config: NedoLMConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = NedoLMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = NedoLMAttention(config, layer_idx)
        self.post_attention_layernorm = NedoLMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = NedoLMMLP(config.hidden_size, config.intermediate_size)
        self.morph = NedoLMMorphExperts(config) if config.num_morph_classes else None

    def forward(
        self,
        x_BSD: Tensor,
        rope: tuple[Tensor, Tensor],
        allowed_B1SL: Tensor,
        route_BSC: Tensor | None,
        cache: Cache | None,
    ) -> Tensor:
        x_BSD = x_BSD + self.self_attn(self.input_layernorm(x_BSD), rope, allowed_B1SL, cache)
        h_BSD = self.post_attention_layernorm(x_BSD)
        out_BSD = self.mlp(h_BSD)
        if self.morph is not None:
            out_BSD = out_BSD + self.morph(h_BSD, route_BSC)
        return x_BSD + out_BSD


class NedoLMPreTrainedModel(PreTrainedModel):
    config_class = NedoLMConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str]] = ["NedoLMDecoderLayer"]


class NedoLMModel(NedoLMPreTrainedModel):
    """The decoder without its output head: final-norm hidden states."""

    def __init__(self, config: NedoLMConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            NedoLMDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = NedoLMRMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.num_morph_classes:
            # The routing is part of the model: saved with the weights, not with the tokenizer.
            classes = torch.full((config.vocab_size,), config.num_morph_classes - 1)
            self.register_buffer("morph_classes", classes)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        position_ids: Tensor | None,
        cache: Cache | None,
    ) -> Tensor:
        B, S = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        device = input_ids.device
        if position_ids is None:
            position_ids = (past + torch.arange(S, device=device)).expand(B, S)
        angles_BSK = position_ids[..., None].double() * rotary_inv_freq(self.config).to(device)
        angles_BSK = torch.cat((angles_BSK, angles_BSK), dim=-1)
        rope = (angles_BSK.cos().float(), angles_BSK.sin().float())
        allowed_B1SL = self._allowed(attention_mask, B, S, past, device)
        route_BSC = None
        if self.config.num_morph_classes:
            classes_BS = self.morph_classes[input_ids]
            route_BSC = F.one_hot(classes_BS, self.config.num_morph_classes)
        x_BSD = self.embed_tokens(input_ids)
        if route_BSC is not None:
            route_BSC = route_BSC.to(x_BSD.dtype)
        for layer in self.layers:
            x_BSD = layer(x_BSD, rope, allowed_B1SL, route_BSC, cache)
        return self.norm(x_BSD)

    @staticmethod
    def _allowed(
        attention_mask: Tensor | None, B: int, S: int, past: int, device: torch.device
    ) -> Tensor:
        """Boolean [B, 1, S, L]: causal, minus padded keys; each token always sees itself, so a
        padding row stays finite instead of attending to nothing."""
        L = past + S
        query_L = past + torch.arange(S, device=device)
        key_L = torch.arange(L, device=device)
        allowed_SL = key_L[None, :] <= query_L[:, None]
        allowed_BSL = allowed_SL.expand(B, S, L)
        if attention_mask is not None:
            if attention_mask.shape != (B, L):
                raise ValueError(
                    f"NedoLM takes a 2-D attention_mask of shape {(B, L)} (batch, cached + new "
                    f"tokens), got {tuple(attention_mask.shape)}"
                )
            itself_SL = key_L[None, :] == query_L[:, None]
            allowed_BSL = (allowed_BSL & attention_mask[:, None, :].bool()) | itself_SL
        return allowed_BSL[:, None]


class NedoLMForCausalLM(NedoLMPreTrainedModel, GenerationMixin):
    _tied_weights_keys: ClassVar[dict[str, str]] = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: NedoLMConfig) -> None:
        super().__init__(config)
        self.model = NedoLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: Cache | None = None,
        past_key_values: Cache | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Next-token logits [B, S, V] (the last ``logits_to_keep`` positions when > 0).

        ``labels`` [B, S] (-100 = ignored) give the mean cross-entropy of predicting
        ``labels[:, 1:]`` from positions ``:-1``, as every transformers causal LM does.
        """
        if input_ids is None:
            raise ValueError("NedoLM routes each token by its id: pass input_ids, not embeddings")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        hidden_BSD = self.model(input_ids, attention_mask, position_ids, cache)
        if logits_to_keep:
            hidden_BSD = hidden_BSD[:, -logits_to_keep:]
        logits_BSV = self.lm_head(hidden_BSD)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits_BSV[:, :-1].float().flatten(0, 1),
                labels[:, 1:].flatten().to(logits_BSV.device),
                ignore_index=-100,
            )
        return CausalLMOutputWithPast(
            loss=loss, logits=logits_BSV, **{_CACHE_FIELD: cache if use_cache else None}
        )
