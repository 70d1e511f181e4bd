"""SFT from a Hugging Face checkpoint: the base it becomes, and the tokenizer it must share.

A Hugging Face model directory (``config.json``, safetensors weights, ``tokenizer.json``) becomes
a base the way a corpus prepared with ``prepare --tokenizer HF_DIR`` needs it: the vocabulary
grows to hold the corpus's control and pad ids (``build_special_tokens`` of the same tokenizer,
so no corpus is needed to know them), and optionally gains morph experts routed by the
tokenizer's pieces. Both changes leave the base's logits at its own ids unchanged at step 0.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from nedolm.data.format import read_special_tokens
from nedolm.data.tokenizer import TextTokenizer, build_special_tokens, load_tokenizer
from nedolm.model import (
    ModelConfig,
    MorphTransformer,
    add_morph_experts,
    grow_vocab,
    import_hf,
    morph_classes_from_vocab,
    read_hf_config,
)
from nedolm.model.morph import N_VOCAB_MORPH_CLASSES

TOKEN_SAMPLE = 256  # token strings compared between a corpus's tokenizer and the base's


class TokenizerMismatchError(ValueError):
    """The corpus was prepared with a tokenizer other than the base model's; names both."""


def hf_base_config(hf_dir: Path, morph_expert_dim: int = 0) -> tuple[ModelConfig, int]:
    """The ModelConfig ``load_hf_base`` builds and the EOS id, without reading any weight."""
    cfg = read_hf_config(hf_dir)
    tokenizer = load_tokenizer(hf_dir)
    cfg = dataclasses.replace(cfg, vocab_size=max(cfg.vocab_size, _corpus_vocab_size(tokenizer)))
    if morph_expert_dim:
        cfg = dataclasses.replace(
            cfg, n_morph_classes=N_VOCAB_MORPH_CLASSES, morph_expert_dim=morph_expert_dim
        )
    return cfg, tokenizer.eos_id


def load_hf_base(hf_dir: Path, morph_expert_dim: int = 0) -> MorphTransformer:
    """The imported model, grown to the corpus vocabulary, with zero-output morph experts.

    Raises:
        HFImportError: the checkpoint cannot be imported (names the file, tensor or field).
        TokenizerError: ``hf_dir`` holds no loadable tokenizer.json.
    """
    model = import_hf(hf_dir)
    tokenizer = load_tokenizer(hf_dir)
    model = grow_vocab(model, max(model.cfg.vocab_size, _corpus_vocab_size(tokenizer)))
    if morph_expert_dim:
        classes = morph_classes_from_vocab(tokenizer.pieces())
        model = add_morph_experts(model, morph_expert_dim, classes)
    return model


def _corpus_vocab_size(tokenizer: TextTokenizer) -> int:
    """The vocabulary a corpus prepared with this tokenizer uses (control and pad ids too)."""
    return build_special_tokens(tokenizer, "").vocab_size


def check_corpus_tokenizer(data_dir: Path, base_tokenizer: Path) -> None:
    """Refuse a corpus whose tokenizer is not the base's: vocabulary size, EOS, token strings.

    Raises:
        TokenizerMismatchError: one line naming both tokenizers and the first difference.
    """
    specials = read_special_tokens(data_dir)
    corpus_path = Path(data_dir) / specials.tokenizer.file
    corpus, base = load_tokenizer(corpus_path), load_tokenizer(base_tokenizer)
    difference = _first_difference(corpus, base)
    if difference:
        raise TokenizerMismatchError(
            f"corpus tokenizer {corpus_path} does not match the base model's tokenizer "
            f"{base.path}: {difference}; prepare the corpus with --tokenizer {base.path.parent}"
        )


def _first_difference(corpus: TextTokenizer, base: TextTokenizer) -> str | None:
    if corpus.base_vocab_size != base.base_vocab_size:
        return f"vocabulary size {corpus.base_vocab_size} != {base.base_vocab_size}"
    if corpus.eos_id != base.eos_id:
        return f"EOS id {corpus.eos_id} != {base.eos_id}"
    sample = torch.linspace(0, base.base_vocab_size - 1, TOKEN_SAMPLE).long().unique().tolist()
    ours, theirs = corpus.pieces(), base.pieces()
    for token_id in sample:
        if ours[token_id] != theirs[token_id]:
            return f"token {token_id} is {ours[token_id]!r} != {theirs[token_id]!r}"
    return None
