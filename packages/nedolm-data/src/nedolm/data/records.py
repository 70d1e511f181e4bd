"""Record layouts and constants shared by the builder, the planner, the verifier and the loader.

Every binary record type is a packed little-endian numpy structured dtype, so a shard file is
a header followed by a flat array that ``np.memmap`` can view without copying.

A document is one conversation. For every message it holds ``<|mesaj_basla|>``, the role
header tokens, the content tokens and ``<|mesaj_bitir|>``; the document ends with EOS, which
belongs to no message. Offsets inside a document are document-relative token positions.
"""

from __future__ import annotations

import numpy as np

MESSAGE_START_TOKEN = "<|mesaj_basla|>"
MESSAGE_END_TOKEN = "<|mesaj_bitir|>"

ROLE_SYSTEM = 0
ROLE_USER = 1
ROLE_ASSISTANT = 2
ROLE_TOOL = 3
ROLE_NAMES = ("system", "user", "assistant", "tool")
"""Role code -> OpenAI role name; the code is the position in this tuple."""

ROLE_HEADERS = {"system": "sistem", "user": "kullanici", "assistant": "asistan", "tool": "araç"}
"""The role registry: role name -> Turkish header word."""

BASE_ROLES = ("system", "user", "assistant")
"""The roles every corpus registers in SPECIAL_TOKENS.json (the seed's registry). The others
(``tool``) are registered only by a corpus holding such messages, so a corpus without them keeps
the seed's contract byte for byte."""


def registered_roles(role_codes: set[int]) -> dict[str, str]:
    """The role registry of a corpus whose messages use ``role_codes``: base roles + those used."""
    return {
        name: ROLE_HEADERS[name]
        for code, name in enumerate(ROLE_NAMES)
        if name in BASE_ROLES or code in role_codes
    }


SEGMENT_DTYPE = np.dtype(
    [
        ("start", "<u4"),  # document-relative position of the message's <|mesaj_basla|>
        ("length", "<u4"),  # whole message: start token + header + content + end token
        ("header_len", "<u2"),  # start token + role header tokens; content begins after it
        ("role", "u1"),  # ROLE_SYSTEM / ROLE_USER / ROLE_ASSISTANT / ROLE_TOOL
        ("trainable", "u1"),  # 1: content and end token are targets; 0: context only
    ]
)
"""One record per message. Targets of a trainable message: ``[start + header_len, start + length)``."""


def target_tokens(segments: np.ndarray) -> int:
    """The assistant targets of one document's ``segments`` (SEGMENT_DTYPE records)."""
    trainable = segments["trainable"] != 0
    lengths = segments["length"][trainable].astype(np.int64)
    return int((lengths - segments["header_len"][trainable]).sum())


INDEX_DTYPE = np.dtype(
    [
        ("doc_key", "<u8"),  # stable 64-bit key of the source record (unique in the corpus)
        ("token_start", "<u8"),  # offset of the document's first token in the shard's tokens
        ("segment_start", "<u8"),  # index of the document's first message in the shard's segments
        ("token_len", "<u4"),  # tokens including the final EOS
        ("segment_count", "<u4"),  # messages in the document
    ]
)
"""One record per document."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, uint32 otherwise (little-endian either way)."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_id(file_name: str) -> int:
    """The integer after the first ``-`` of a shard file name: ``sft-00053-of-00064…`` -> 53."""
    try:
        return int(file_name.split("-")[1])
    except (IndexError, ValueError) as exc:
        raise ValueError(f"cannot parse a shard id from file name {file_name!r}") from exc
