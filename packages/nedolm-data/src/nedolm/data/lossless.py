"""Which ``tokenizer.json`` pipelines give every text back, so the builder can skip decoding.

The builder counts, per source, the characters that encode → decode loses; decoding costs about
0.6x of encoding. A pipeline built only of reversible steps cannot lose a character: a
normaliser that only writes spaces as ``▁``, pre-tokenizers that split without removing, and a
BPE model that falls back to bytes (or works on bytes), so nothing becomes ``<unk>``. Anything
else (NFKC, a precompiled SentencePiece charsmap, whitespace removal, a model without byte
fallback) is lossy or unknown, and the builder decodes. A probe of awkward text checks the
decoder on top.

One exception to "every text": a ``▁`` already in the text comes back as a space (the decoder
cannot tell it from a space the normaliser wrote), so the builder still decodes the texts that
hold one.
"""

from __future__ import annotations

from typing import Any

SPACE_MARK = "\u2581"  # "▁", SentencePiece's visible space
PROBE = (
    "  İki  boşluk,\n\tsekme ve satır\r\n sonu; é e\u0301 ﬁ ① Ａ Ⅸ ß ς 🙂 中文 ⁇ <s> <unk>"
    " \u200b\u00a0x  "
)
"""Leading, repeated and trailing whitespace, newlines, tabs, decomposed and compatibility
characters, other scripts, an emoji, a zero-width and a no-break space, special-token text."""

_BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
_REVERSIBLE_NORMALISERS = (
    {"type": "Prepend", "prepend": SPACE_MARK},
    {"type": "Replace", "pattern": {"String": " "}, "content": SPACE_MARK},
    {"type": "Replace", "pattern": {"Regex": f"\\A{SPACE_MARK}"}, "content": SPACE_MARK * 2},
)
_SPLITTING_PRE_TOKENIZERS = {"Metaspace", "ByteLevel", "Split", "Digits", "Punctuation"}


def reversible_pipeline(doc: dict[str, Any]) -> bool:
    """True when every step of the tokenizer.json ``doc`` is reversible (see the module doc)."""
    model = doc.get("model") or {}
    normalisers = _steps(doc.get("normalizer"), "normalizers")
    pre_tokenizers = _steps(doc.get("pre_tokenizer"), "pretokenizers")
    if doc.get("decoder") is None or model.get("type") != "BPE":
        return False
    if not all(step in _REVERSIBLE_NORMALISERS for step in normalisers):
        return False
    if not all(
        step.get("type") in _SPLITTING_PRE_TOKENIZERS and step.get("behavior") != "Removed"
        for step in pre_tokenizers
    ):
        return False
    byte_level = any(step.get("type") == "ByteLevel" for step in pre_tokenizers)
    vocab = model.get("vocab") or {}
    byte_fallback = bool(model.get("byte_fallback")) and all(t in vocab for t in _BYTE_TOKENS)
    return byte_level or byte_fallback


def _steps(component: dict[str, Any] | None, children: str) -> list[dict[str, Any]]:
    """The steps of a pipeline component, nested ``Sequence``s flattened."""
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [step for child in component.get(children, []) for step in _steps(child, children)]
    return [component]
