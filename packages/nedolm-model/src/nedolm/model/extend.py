"""Grow a pretrained base without changing what it computes: more vocabulary rows, morph experts.

An imported checkpoint knows neither the corpus's control tokens nor morph routing. Both are
added here so that, at step 0, the grown model gives exactly the base's logits at every id the
base had: new vocabulary rows only add ids (initialised to the mean of the existing rows, a
neutral start for the optimizer), and new morph experts have zero output projections.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from nedolm.model.config import ModelConfig
from nedolm.model.model import MorphTransformer, build_model
from nedolm.model.morph import N_VOCAB_MORPH_CLASSES

_VOCAB_WEIGHTS = ("tok_embeddings.weight", "output.weight")


def grow_vocab(model: MorphTransformer, vocab_size: int) -> MorphTransformer:
    """A copy of `model` whose logical vocabulary holds `vocab_size` ids.

    Rows of ids the model already had are copied bit for bit (embedding and untied head); each
    new row is the mean of the old logical rows; padding rows stay zero; new ids take the last
    morph class, as ids past a tokenizer do.

    Raises:
        ValueError: `vocab_size` is smaller than the model's vocabulary.
    """
    cfg = model.cfg
    if vocab_size < cfg.vocab_size:
        raise ValueError(
            f"grow_vocab: vocab_size {vocab_size} is smaller than the model's {cfg.vocab_size}"
        )
    grown = _with_config(model, vocab_size=vocab_size)
    state = model.state_dict()
    with torch.no_grad():
        for name in _VOCAB_WEIGHTS:
            if name in state:
                state[name] = _grown_rows(state[name], cfg.vocab_size, grown.cfg)
    if cfg.n_morph_classes:
        classes = torch.full_like(grown.morph_classes, cfg.n_morph_classes - 1)
        classes[: cfg.vocab_size] = state["morph_classes"][: cfg.vocab_size]
        state["morph_classes"] = classes
    grown.load_state_dict(state)
    return grown


def _grown_rows(weight_WD: Tensor, old_vocab: int, cfg: ModelConfig) -> Tensor:
    old_VD = weight_WD[:old_vocab]
    out = weight_WD.new_zeros(cfg.padded_vocab_size, weight_WD.size(1))
    out[:old_vocab] = old_VD
    out[old_vocab : cfg.vocab_size] = old_VD.float().mean(0).to(out.dtype)
    return out


def add_morph_experts(
    model: MorphTransformer, expert_dim: int, classes: Tensor, *, dispatch: str = "masked"
) -> MorphTransformer:
    """A copy of dense `model` with morph experts that contribute nothing yet.

    Experts get the usual random gate/up projections and zero output projections, so the
    output equals the dense model's exactly at step 0 while gradients still reach every expert
    (through the output projection first).

    Args:
        model: a dense model (n_morph_classes == 0).
        expert_dim: hidden width of each expert's SwiGLU.
        classes: morph class per id (`morph_classes_from_vocab` of the tokenizer's pieces).
        dispatch: "masked" or "sparse".

    Raises:
        ValueError: the model already has morph experts, or the classes do not fit.
    """
    if model.cfg.n_morph_classes:
        raise ValueError("add_morph_experts: the model already has morph experts")
    morph = _with_config(
        model,
        n_morph_classes=N_VOCAB_MORPH_CLASSES,
        morph_expert_dim=expert_dim,
        morph_dispatch=dispatch,
    )
    state = {**morph.state_dict(), **model.state_dict()}
    for name, value in state.items():
        if name.endswith("morph.w_down"):
            state[name] = torch.zeros_like(value)
    morph.load_state_dict(state)
    morph.set_morph_classes(classes)
    return morph


def _with_config(model: MorphTransformer, **changes: object) -> MorphTransformer:
    new = build_model(dataclasses.replace(model.cfg, **changes))
    first = next(model.parameters())
    return new.to(device=first.device, dtype=first.dtype)
