"""MorphTransformer: a Llama-style decoder with per-class morph experts and a fused loss head.

Pre-norm RMSNorm, rotary positions indexed by `position_ids`, grouped-query attention over
packed segments, SwiGLU, no biases, input/output embeddings padded to a multiple of 64 rows and
tied unless `cfg.tie_embeddings` is False (then the head is its own `output` weight). Tokens travel flattened as [T, D] through the blocks so packed and unpacked batches
share one code path. With `n_morph_classes == 0` the model is numerically a Llama model.
"""

# Shape legend: B rows, S row length, T = B*S tokens, D model dim, H query heads,
# G kv heads, K head dim, F ffn dim, V logical vocab, W padded vocab, N target tokens.
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from nedolm.model.attention import VarlenLayout, build_layout, varlen_attention
from nedolm.model.attn_select import resolve_attn_impl
from nedolm.model.config import ModelConfig
from nedolm.model.layout import positions_from_cu_seqlens
from nedolm.model.loss import IGNORE_INDEX, fused_linear_cross_entropy
from nedolm.model.morph import MorphExperts, MorphRoute
from nedolm.model.rope import apply_rope, rope_table

if TYPE_CHECKING:
    from nedolm.model.generate import KVCache


class RMSNorm(nn.Module):
    """x / rms(x) * weight, no bias."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 (bf16 sums of squares lose digits), as Llama does.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary q/k over packed segments (or a KV cache)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv_dim = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.wqkv = nn.Linear(cfg.d_model, qkv_dim, bias=False)  # one GEMM for q, k and v
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(
        self,
        x_TD: Tensor,
        cos_TK: Tensor,
        sin_TK: Tensor,
        layout: VarlenLayout | None,
        cache: KVCache | None,
    ) -> Tensor:
        T, K = x_TD.size(0), self.head_dim
        qkv = self.wqkv(x_TD)
        q_THK, k_TGK, v_TGK = qkv.split(
            (self.n_heads * K, self.n_kv_heads * K, self.n_kv_heads * K), dim=-1
        )
        q_THK = apply_rope(q_THK.view(T, self.n_heads, K), cos_TK, sin_TK)
        k_TGK = apply_rope(k_TGK.view(T, self.n_kv_heads, K), cos_TK, sin_TK)
        v_TGK = v_TGK.view(T, self.n_kv_heads, K)
        if cache is not None:
            out_THK = cache.attend(self.layer, q_THK, k_TGK, v_TGK)
        else:
            assert layout is not None
            out_THK = varlen_attention(q_THK, k_TGK, v_TGK, layout)
        return self.wo(out_THK.reshape(T, -1))


class FeedForward(nn.Module):
    """Shared SwiGLU path (gate and up projections fused into one GEMM)."""

    def __init__(self, d_model: int, ffn_dim: int) -> None:
        super().__init__()
        self.ffn_dim = ffn_dim
        self.w_gate_up = nn.Linear(d_model, 2 * ffn_dim, bias=False)
        self.w_down = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x_TD: Tensor) -> Tensor:
        gate_TF, up_TF = self.w_gate_up(x_TD).split(self.ffn_dim, dim=-1)
        return self.w_down(F.silu(gate_TF) * up_TF)


class Block(nn.Module):
    """Pre-norm attention, then the shared SwiGLU plus the token's morph expert."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg.d_model, cfg.ffn_dim)
        self.morph = None
        if cfg.n_morph_classes:
            self.morph = MorphExperts(
                cfg.d_model, cfg.n_morph_classes, cfg.morph_expert_dim, cfg.morph_dispatch
            )

    def forward(
        self,
        x_TD: Tensor,
        cos_TK: Tensor,
        sin_TK: Tensor,
        layout: VarlenLayout | None,
        route: MorphRoute | None,
        cache: KVCache | None = None,
    ) -> Tensor:
        x_TD = x_TD + self.attn(self.attn_norm(x_TD), cos_TK, sin_TK, layout, cache)
        h_TD = self.ffn_norm(x_TD)
        out_TD = self.ffn(h_TD)
        if self.morph is not None and route is not None:
            out_TD = out_TD + self.morph(h_TD, route)
        return x_TD + out_TD


class MorphTransformer(nn.Module):
    """Decoder-only LM; see the module docstring. Build it with `build_model(cfg)`.

    `init_weights=False` leaves every parameter and buffer unset: `build_model` constructs so on
    the meta device, then gives the model memory and its buffers."""

    def __init__(self, cfg: ModelConfig, *, init_weights: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.grad_checkpoint = False  # recompute each block in backward to save activations
        self._compiled_blocks: list[nn.Module] = []  # see compile_blocks
        # A given weight skips nn.Embedding's own normal_ draw, which on the meta device
        # imports torch._dynamo (a second of start-up for a process that never compiles).
        unset = None if init_weights else torch.empty(cfg.padded_vocab_size, cfg.d_model)
        self.tok_embeddings = nn.Embedding(cfg.padded_vocab_size, cfg.d_model, _weight=unset)
        self.blocks = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = None
        if not cfg.tie_embeddings:
            self.output = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        self.register_buffer("rope_cos", None, persistent=False)  # set by reset_buffers
        self.register_buffer("rope_sin", None, persistent=False)
        if cfg.n_morph_classes:
            # Saved with the weights: the routing is part of the model, not of the tokenizer.
            classes = torch.empty(cfg.padded_vocab_size, dtype=torch.long)
            self.register_buffer("morph_classes", classes)
        if init_weights:  # else build_model sets the buffers once the model has memory
            self.reset_buffers()
            self.reset_parameters()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The rotary tables, and every id routed to the last morph class (until
        `set_morph_classes` or a checkpoint says otherwise)."""
        cfg, device = self.cfg, self.tok_embeddings.weight.device
        cos, sin = rope_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        if cfg.n_morph_classes:
            self.morph_classes.fill_(cfg.n_morph_classes - 1)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; residual projections scaled by 1/sqrt(2 * n_layers)."""
        std = self.cfg.init_std
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(("wo.weight", "w_down.weight", "morph.w_down")):
                param.normal_(0.0, residual_std)
            else:
                param.normal_(0.0, std)
        self.tok_embeddings.weight[self.cfg.vocab_size :].zero_()  # padding rows: never used
        self.output_weight[self.cfg.vocab_size :].zero_()

    @property
    def output_weight(self) -> Tensor:
        """The output head [padded vocab, D]: the input embedding when tied."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def set_morph_classes(self, classes: Tensor) -> None:
        """Set the morph class of ids 0..len(classes)-1; later ids get the last class.

        Raises:
            ValueError: the model has no morph experts, or the classes do not fit.
        """
        cfg = self.cfg
        if not cfg.n_morph_classes:
            raise ValueError("set_morph_classes: model is dense (n_morph_classes=0)")
        if classes.ndim != 1 or len(classes) > cfg.vocab_size:
            raise ValueError(
                f"set_morph_classes: need a 1-D tensor of at most vocab_size={cfg.vocab_size} "
                f"classes, got shape {tuple(classes.shape)}"
            )
        if len(classes) and not 0 <= int(classes.min()) <= int(classes.max()) < cfg.n_morph_classes:
            raise ValueError(
                f"set_morph_classes: classes must lie in [0, {cfg.n_morph_classes}), got "
                f"[{int(classes.min())}, {int(classes.max())}]"
            )
        self.morph_classes.fill_(cfg.n_morph_classes - 1)
        self.morph_classes[: len(classes)] = classes.to(self.morph_classes)

    def compile_blocks(self, **compile_args: Any) -> None:
        """Have training-mode forwards run each block as ``torch.compile(block, **compile_args)``.

        Regional compilation: every block runs the same code, so one traced graph serves them
        all and compiling costs one block's time whatever the depth (a whole-model compile
        unrolls every layer: 3.2x the warm-up at nedolm-0.8b's 24, `bench/compile.py`). What
        lies outside the blocks (embedding, rotary tables, routing, the loss head, itself one
        op) runs eagerly: a handful of kernels per forward. Eval mode runs the blocks eagerly:
        validation runs without grad (its batches' shapes vary), generation grows a cache,
        and either would otherwise trace new graphs. The compiled wrappers are not submodules:
        weights, state dicts and FSDP's sharding see the plain blocks.
        """
        self._compiled_blocks = [torch.compile(block, **compile_args) for block in self.blocks]

    def uncompile_blocks(self) -> None:
        """Run every block eagerly again (after a failed compile warm-up)."""
        self._compiled_blocks = []

    @property
    def blocks_compiled(self) -> bool:
        """Whether training-mode forwards run compiled blocks (``compile_blocks``)."""
        return bool(self._compiled_blocks)

    def num_params(self) -> int:
        """Parameter count (each tied weight once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        *,
        return_logits: bool = True,
        loss_reduction: str = "mean",
        loss_fp32_logits: bool = True,
        cu_seqlens: Tensor | None = None,
        max_seqlen: int | None = None,
        position_ids: Tensor | None = None,
        target_index: Tensor | None = None,
        host_cu_seqlens: Tensor | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """Logits and/or the loss of next-token prediction.

        Args:
            input_ids: [B, S] (or [S]) token ids.
            labels: same shape, target id per position or -100 (IGNORE_INDEX) for context.
            return_logits: return [..., vocab_size] logits; with labels and False, the loss is
                computed only at target positions and logits never exist.
            loss_reduction: "sum" or "mean" over target positions; "none" (fused head only,
                without gradients) gives each scored row's loss [N], 0 on padding rows.
            loss_fp32_logits: compute the softmax of the loss in float32.
            cu_seqlens: int32 [N + 1] segment offsets into the flattened tokens; default: each
                row is one sequence.
            max_seqlen: longest segment (saves a host sync on the kernel backends).
            position_ids: rotary positions, same shape as input_ids; default: derived from
                cu_seqlens (0 at every segment start).
            target_index: int64 [N] flattened positions the fused head scores (see
                `target_rows`); default: every position whose label is not ignored, found on
                the device (data-dependent: a host sync, and a graph break when compiled).
            host_cu_seqlens: the same offsets as cu_seqlens, on the CPU (saves the sdpa
                backend's host sync).

        Returns:
            (loss, logits): loss is None without labels, logits None if not requested.
        """
        if labels is None and not return_logits:
            raise ValueError("forward: nothing to compute (no labels and return_logits=False)")
        if input_ids.ndim not in (1, 2):
            raise ValueError(
                f"forward: input_ids must be [B, S] or [S], got {tuple(input_ids.shape)}"
            )
        shape = input_ids.shape
        if labels is not None and labels.shape != shape:
            raise ValueError(
                f"forward: labels shape {tuple(labels.shape)} != input_ids shape {tuple(shape)}"
            )
        ids_T = input_ids.reshape(-1)
        T = ids_T.numel()
        if cu_seqlens is None:
            row_len = shape[-1]
            cu_seqlens = torch.arange(0, T + 1, row_len, dtype=torch.int32, device=ids_T.device)
            host_cu_seqlens = torch.arange(0, T + 1, row_len, dtype=torch.int32)  # no copy back
            max_seqlen = row_len
        device = ids_T.device
        dtype = (  # what attention computes in: the autocast dtype, else the weights'
            torch.get_autocast_dtype(device.type)
            if torch.is_autocast_enabled(device.type)
            else self.tok_embeddings.weight.dtype
        )
        impl = resolve_attn_impl(self.cfg.attn_impl, device, dtype, backward=False)
        blocks = self._compiled_blocks if self.training and self._compiled_blocks else self.blocks
        compiled = blocks is not self.blocks
        layout = build_layout(
            impl, cu_seqlens, max_seqlen, T, compiled=compiled, host_cu_seqlens=host_cu_seqlens
        )
        if position_ids is None:
            positions_T = positions_from_cu_seqlens(cu_seqlens, T)
        elif position_ids.numel() == T:
            positions_T = position_ids.reshape(-1)
        else:
            raise ValueError(
                f"forward: position_ids shape {tuple(position_ids.shape)} does not match "
                f"input_ids shape {tuple(shape)}"
            )
        hidden_TD = self.hidden_states(ids_T, positions_T, layout, blocks)

        loss = logits = None
        if labels is not None and not return_logits:
            index_N, targets_N = target_rows(labels.reshape(-1), target_index)
            loss = fused_linear_cross_entropy(
                hidden_TD.index_select(0, index_N),
                self.output_weight,
                targets_N,
                vocab_size=self.cfg.vocab_size,
                reduction=loss_reduction,
                fp32_logits=loss_fp32_logits,
            )
        if return_logits:
            logits_TV = F.linear(hidden_TD, self.output_weight[: self.cfg.vocab_size])
            if labels is not None:
                if loss_reduction not in ("sum", "mean"):
                    raise ValueError(
                        f"loss_reduction must be 'sum' or 'mean' with return_logits (a loss "
                        f"per row comes from the fused head), got {loss_reduction!r}"
                    )
                loss = F.cross_entropy(
                    logits_TV.float() if loss_fp32_logits else logits_TV,
                    labels.reshape(-1),
                    ignore_index=IGNORE_INDEX,
                    reduction=loss_reduction,
                )
            logits = logits_TV.view(*shape, -1)
        return loss, logits

    def hidden_states(
        self,
        ids_T: Tensor,
        positions_T: Tensor,
        layout: VarlenLayout,
        blocks: Sequence[nn.Module],
    ) -> Tensor:
        """Final-norm hidden states [T, D] of flattened tokens through `blocks` (the model's
        own, or their compiled wrappers)."""
        x_TD = self.tok_embeddings(ids_T)
        cos_TK, sin_TK = self.rope_cos[positions_T], self.rope_sin[positions_T]
        route = self._route(ids_T)
        for block in blocks:
            if self.grad_checkpoint and torch.is_grad_enabled():
                x_TD = checkpoint(block, x_TD, cos_TK, sin_TK, layout, route, use_reentrant=False)
            else:
                x_TD = block(x_TD, cos_TK, sin_TK, layout, route)
        return self.norm(x_TD)

    @torch.no_grad()
    def decode(self, ids_T: Tensor, cache: KVCache) -> Tensor:
        """Float32 logits [V] after feeding `ids_T` on top of the tokens already in `cache`."""
        positions_T = cache.length + torch.arange(len(ids_T), device=ids_T.device)
        x_TD = self.tok_embeddings(ids_T)
        cos_TK, sin_TK = self.rope_cos[positions_T], self.rope_sin[positions_T]
        route = self._route(ids_T)
        for block in self.blocks:
            x_TD = block(x_TD, cos_TK, sin_TK, None, route, cache)
        cache.advance(len(ids_T))
        hidden_D = self.norm(x_TD[-1])
        return F.linear(hidden_D, self.output_weight[: self.cfg.vocab_size]).float()

    def _route(self, ids_T: Tensor) -> MorphRoute | None:
        cfg = self.cfg
        if not cfg.n_morph_classes:
            return None
        classes_T = self.morph_classes[ids_T]
        return MorphRoute(classes_T, cfg.n_morph_classes, cfg.morph_expert_dim, cfg.morph_dispatch)


def target_rows(labels_T: Tensor, target_index: Tensor | None) -> tuple[Tensor, Tensor]:
    """The rows the fused head scores and their targets: (index [N], targets [N]).

    `target_index` lists flattened target positions, padded with -1 entries (scored as
    IGNORE_INDEX) so that callers can give it a size of their choosing; a compiled forward
    then never depends on the number of targets. Without it the targets are found here.
    """
    if target_index is None:
        index_N = (labels_T != IGNORE_INDEX).nonzero().squeeze(1)
        return index_N, labels_T.index_select(0, index_N)
    padding_N = target_index < 0
    index_N = target_index.clamp_min(0)
    targets_N = labels_T.index_select(0, index_N).masked_fill(padding_N, IGNORE_INDEX)
    return index_N, targets_N


def build_model(
    cfg: ModelConfig,
    *,
    init_weights: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> MorphTransformer:
    """Construct a model on `device` (default: torch's default device), freshly initialised;
    `dtype` converts its floating parameters and buffers as ``Module.to(dtype)`` does.

    ``init_weights=False``: the parameters are allocated but not set (the buffers are), for
    loading a whole state dict into, strictly: random draws that the load overwrites take
    seconds for nedolm-0.8b on a CPU (``generate``, ``chat`` and ``export`` wait for them).
    The memory is allocated on `device` in `dtype` directly: a trainer on a GPU needs no host
    copy of the model to move there, ``generate`` no float32 copy to convert.
    """
    device = torch.get_default_device() if device is None else torch.device(device)
    if init_weights:
        with device:
            model = MorphTransformer(cfg)
    else:
        with torch.device("meta"):  # no memory, no draws (torch's own layer init included)
            model = MorphTransformer(cfg, init_weights=False)
        if dtype is not None:
            model.to(dtype)  # on the meta device: nothing is converted
        model.to_empty(device=device)
        model.reset_buffers()
    return model if dtype is None else model.to(dtype)  # the rotary tables, when not yet
