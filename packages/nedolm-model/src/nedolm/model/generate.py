"""Incremental decoding with a KV cache: greedy, temperature and top-p sampling, a repetition
penalty, stop ids.

`generate` is an iterator so a CLI can print tokens as they arrive. The prompt is fed once
(prefill); every later step feeds one token and attends over the cached keys and values.
"""

# Shape legend: T new tokens, L cached tokens, H query heads, G kv heads, K head dim, V vocab.
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from nedolm.model.model import MorphTransformer


class KVCache:
    """Keys and values of every layer for one sequence, preallocated to `max_len` tokens."""

    def __init__(
        self,
        n_layers: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.k_LGK = torch.zeros(
            n_layers, max_len, n_kv_heads, head_dim, device=device, dtype=dtype
        )
        self.v_LGK = torch.zeros_like(self.k_LGK)
        self.length = 0  # tokens whose keys/values every layer has stored

    def attend(self, layer: int, q_THK: Tensor, k_TGK: Tensor, v_TGK: Tensor) -> Tensor:
        """Store this layer's new keys/values, then attend causally over the whole prefix."""
        start, end = self.length, self.length + q_THK.size(0)
        if end > self.k_LGK.size(1):
            raise RuntimeError(f"KV cache holds {self.k_LGK.size(1)} tokens, needs {end}")
        self.k_LGK[layer, start:end] = k_TGK
        self.v_LGK[layer, start:end] = v_TGK
        key_pos_L = torch.arange(end, device=q_THK.device)
        query_pos_T = torch.arange(start, end, device=q_THK.device)
        allowed_TL = key_pos_L[None, :] <= query_pos_T[:, None]
        k_GLK, v_GLK = (
            c[layer, :end].transpose(0, 1).to(q_THK.dtype) for c in (self.k_LGK, self.v_LGK)
        )
        out_HTK = F.scaled_dot_product_attention(
            q_THK.transpose(0, 1), k_GLK, v_GLK, attn_mask=allowed_TL, enable_gqa=True
        )
        return out_HTK.transpose(0, 1)

    def advance(self, n_tokens: int) -> None:
        self.length += n_tokens


@torch.no_grad()
def generate(
    model: MorphTransformer,
    prompt_ids: Sequence[int] | Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    stop_ids: Iterable[int] = (),
    generator: torch.Generator | None = None,
) -> Iterator[int]:
    """Yield up to `max_new_tokens` token ids continuing `prompt_ids`.

    Args:
        model: the model (switched to eval mode for the duration, then restored).
        prompt_ids: one non-empty prompt.
        max_new_tokens: tokens to produce at most.
        temperature: 0 picks the argmax (greedy); > 0 samples from softmax(logits / t).
        top_p: keep the smallest set of tokens whose probability reaches top_p (nucleus).
        repetition_penalty: > 1 discourages every id already in the prompt or the reply (the
            CTRL paper's rule, as transformers applies it: a positive logit is divided by it,
            a negative one multiplied); 1 turns it off.
        stop_ids: generation ends when one of these is produced; it is not yielded.
        generator: CPU random generator for sampling (reproducible runs).

    Raises:
        ValueError: empty prompt, prompt + new tokens beyond max_seq_len, or bad sampling knobs.
    """
    cfg = model.cfg
    device = model.tok_embeddings.weight.device
    prompt_T = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(-1)
    if prompt_T.numel() == 0:
        raise ValueError("generate: prompt_ids is empty")
    if max_new_tokens < 0 or temperature < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(
            f"generate: need max_new_tokens >= 0, temperature >= 0, 0 < top_p <= 1; got "
            f"{max_new_tokens}, {temperature}, {top_p}"
        )
    if repetition_penalty <= 0:
        raise ValueError(f"generate: repetition_penalty must be > 0, got {repetition_penalty}")
    total = prompt_T.numel() + max_new_tokens
    if total > cfg.max_seq_len:
        raise ValueError(
            f"generate: prompt ({prompt_T.numel()}) + max_new_tokens ({max_new_tokens}) exceeds "
            f"max_seq_len={cfg.max_seq_len}"
        )
    stops = set(stop_ids)
    cache = KVCache(
        cfg.n_layers,
        total,
        cfg.n_kv_heads,
        cfg.head_dim,
        device=device,
        dtype=model.tok_embeddings.weight.dtype,
    )
    was_training = model.training
    model.eval()
    try:
        next_ids_T = prompt_T
        seen_V = torch.zeros(cfg.vocab_size, dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            logits_V = model.decode(next_ids_T, cache)
            if repetition_penalty != 1.0:
                seen_V[next_ids_T] = True
                logits_V = penalize_repeats(logits_V, seen_V, repetition_penalty)
            token = sample_token(logits_V, temperature, top_p, generator)
            if token in stops:
                return
            yield token
            next_ids_T = torch.tensor([token], device=device)
    finally:
        model.train(was_training)


def penalize_repeats(logits_V: Tensor, seen_V: Tensor, penalty: float) -> Tensor:
    """Logits with every ``seen_V`` id made less likely by ``penalty`` (> 1), sign-aware."""
    penalized = torch.where(logits_V > 0, logits_V / penalty, logits_V * penalty)
    return torch.where(seen_V, penalized, logits_V)


def sample_token(
    logits_V: Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> int:
    """Pick one id: argmax at temperature 0, else a draw from the top-p nucleus."""
    if temperature == 0:
        return int(logits_V.argmax())
    probs_V = torch.softmax(logits_V.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs_V.sort(descending=True)
        # Keep a token if the mass before it is below top_p (the first token always stays).
        keep = sorted_probs.cumsum(0) - sorted_probs < top_p
        probs_V = torch.zeros_like(probs_V).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs_V.cpu(), 1, generator=generator))
