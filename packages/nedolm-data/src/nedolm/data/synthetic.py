"""Synthetic corpora laid out exactly per SPEC §2, for property tests and benchmarks.

Conversations are given as per-message lengths and roles (no tokenizer), and turned into the
same token, segment and index arrays the builder writes, laid out by the renderer
(``nedolm.data.render``). Everything is vectorised so a benchmark can lay out millions of
conversations in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from nedolm.data.format import (
    SHARDS_DIR,
    SPECIAL_TOKENS_FILE,
    ControlToken,
    SpecialTokens,
    TokenizerInfo,
    shard_file_name,
    write_array,
)
from nedolm.data.packing import flat_ranges
from nedolm.data.records import (
    BASE_ROLES,
    INDEX_DTYPE,
    MESSAGE_END_TOKEN,
    MESSAGE_START_TOKEN,
    ROLE_ASSISTANT,
    ROLE_SYSTEM,
    ROLE_USER,
    registered_roles,
)
from nedolm.data.render import ConversationLayout, message_segments, message_starts
from nedolm.data.schema import SPECIAL_TOKENS_SCHEMA

MESSAGE_START_ID = 32000
MESSAGE_END_ID = 32001
EOS_ID = 2
PAD_ID = 3
FIRST_CONTENT_ID = 4  # ids below are EOS/pad/specials, never content
UNIQUE_BASE_ID = 16  # write_corpus(unique_tokens=True): first id, above EOS and pad
SYNTHETIC_LAYOUT = ConversationLayout(
    start_id=MESSAGE_START_ID,
    end_id=MESSAGE_END_ID,
    eos_id=EOS_ID,
    headers={name: [FIRST_CONTENT_ID + code] for code, name in enumerate(BASE_ROLES)},
)
"""The renderer's ids for synthetic corpora: header tokens are ``FIRST_CONTENT_ID + role``."""


@dataclass(frozen=True)
class Conversations:
    """Messages of many conversations, flattened: conversation ``i`` owns ``counts[i]`` rows."""

    counts: np.ndarray  # messages per conversation
    role: np.ndarray  # role code per message
    header_len: np.ndarray  # <|mesaj_basla|> + role header tokens, per message
    content_len: np.ndarray  # content tokens per message
    trainable: np.ndarray  # bool per message

    @classmethod
    def from_lists(cls, conversations: list[list[tuple[int, int, int, bool]]]) -> Conversations:
        """From ``[[(role, header_len, content_len, trainable), ...], ...]``."""
        flat = [m for conv in conversations for m in conv]
        columns = np.array(flat, dtype=np.int64).reshape(-1, 4)
        return cls(
            counts=np.array([len(c) for c in conversations], np.int64),
            role=columns[:, 0],
            header_len=columns[:, 1],
            content_len=columns[:, 2],
            trainable=columns[:, 3].astype(bool),
        )


def random_conversations(
    rng: np.random.Generator, n: int, max_content: int, max_turns: int = 5
) -> Conversations:
    """``n`` chats: an optional system message, then 1..max_turns user/assistant turns.

    About one assistant message in ten is context only (as a tool call would be).
    """
    conversations = []
    for _ in range(n):
        conv = [(ROLE_SYSTEM, 2, int(rng.integers(0, max_content)), False)] * int(
            rng.random() < 0.3
        )
        for _ in range(int(rng.integers(1, max_turns + 1))):
            conv.append((ROLE_USER, 3, int(rng.integers(0, max_content)), False))
            conv.append((ROLE_ASSISTANT, 2, int(rng.integers(0, max_content)), rng.random() < 0.9))
        conversations.append(conv)
    return Conversations.from_lists(conversations)


def sample_conversations(params: dict, n: int, seed: int) -> Conversations:
    """``n`` conversations drawn from measured histograms (``bench/packing_lengths.json``).

    ``params["shapes"]`` maps ``"has_system:assistant_turns"`` to a count; per-role content
    lengths come from ``params["content_tokens"][role]`` (values, counts) and header lengths
    from ``params["header_len"][role]``. Vectorised: millions of conversations in seconds.
    """
    rng = np.random.default_rng(seed)
    keys = list(params["shapes"])
    weights = np.array([params["shapes"][k] for k in keys], np.float64)
    shape = rng.choice(len(keys), size=n, p=weights / weights.sum())
    has_system = np.array([int(k.split(":")[0]) for k in keys])[shape]
    turns = np.array([int(k.split(":")[1]) for k in keys])[shape]
    counts = has_system + 2 * turns
    # Message j of a conversation: system first if present, then user/assistant alternating.
    conv = np.repeat(np.arange(n), counts)
    j = flat_ranges(counts)
    role = np.where(
        (j == 0) & (has_system[conv] == 1),
        ROLE_SYSTEM,
        np.where((j - has_system[conv]) % 2 == 0, ROLE_USER, ROLE_ASSISTANT),
    )
    content = np.zeros(len(role), np.int64)
    header = np.zeros(len(role), np.int64)
    for code, name in enumerate(BASE_ROLES):
        hist = params["content_tokens"][name]
        mask = role == code
        p = np.array(hist["counts"], np.float64)
        content[mask] = rng.choice(np.array(hist["values"]), size=int(mask.sum()), p=p / p.sum())
        header[mask] = params["header_len"][name]
    return Conversations(
        counts=counts,
        role=role,
        header_len=header,
        content_len=content,
        trainable=role == ROLE_ASSISTANT,
    )


def layout(conversations: Conversations) -> tuple[np.ndarray, np.ndarray]:
    """Index and segment records (INDEX_DTYPE, SEGMENT_DTYPE) of the conversations."""
    counts = conversations.counts.astype(np.int64)
    segments = message_segments(
        counts,
        conversations.role,
        conversations.header_len - 1,  # the renderer counts header tokens without the start
        conversations.content_len,
        conversations.trainable,
    )
    doc_of = np.repeat(np.arange(len(counts)), counts)
    length = segments["length"].astype(np.int64)
    doc_len = np.bincount(doc_of, weights=length, minlength=len(counts)).astype(np.int64) + 1

    index = np.empty(len(counts), INDEX_DTYPE)
    index["doc_key"] = np.arange(len(counts), dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    index["token_start"] = np.concatenate([[0], np.cumsum(doc_len)[:-1]])
    index["segment_start"] = np.cumsum(counts) - counts
    index["token_len"] = doc_len
    index["segment_count"] = counts
    return index, segments


def tokens_for(
    index: np.ndarray, segments: np.ndarray, vocab_size: int = 32000, seed: int = 0
) -> np.ndarray:
    """Token ids for a layout: random content, control tokens and EOS where SPEC §2 puts them.

    Header tokens are ``FIRST_CONTENT_ID + role`` so a test can tell roles apart by eye.
    """
    total = int(index["token_len"].astype(np.int64).sum())
    dtype = np.uint16 if vocab_size + 2 <= 1 << 16 else np.uint32
    rng = np.random.default_rng(seed)
    tokens = rng.integers(FIRST_CONTENT_ID + len(BASE_ROLES), vocab_size, size=total)
    start = message_starts(index, segments)
    header_len = segments["header_len"].astype(np.int64)
    in_header = np.repeat(start, header_len) + flat_ranges(header_len)
    tokens[in_header] = FIRST_CONTENT_ID + np.repeat(segments["role"].astype(np.int64), header_len)
    SYNTHETIC_LAYOUT.place_control_ids(tokens, index, segments)
    return tokens.astype(dtype)


def write_corpus(
    data_dir: Path, shards: list[Conversations], seed: int = 0, unique_tokens: bool = False
) -> None:
    """Write ``shards`` as a corpus directory (shard files + SPECIAL_TOKENS.json).

    Only what readers of the binaries need: the contract reports are the builder's job.
    With ``unique_tokens`` every token id is ``UNIQUE_BASE_ID`` + its position in the whole
    corpus (shards in order), so a test can tell where every token a loader emits came from.
    """
    shards_dir = Path(data_dir) / SHARDS_DIR
    shards_dir.mkdir(parents=True, exist_ok=True)
    next_id = UNIQUE_BASE_ID
    for shard_id, conversations in enumerate(shards):
        index, segments = layout(conversations)
        if unique_tokens:
            total = int(index["token_len"].astype(np.int64).sum())
            tokens = np.arange(next_id, next_id + total, dtype=np.uint32)
            next_id += total
        else:
            tokens = tokens_for(index, segments, seed=seed + shard_id)
        arrays = {"tokens": tokens, "segments": segments, "index": index}
        for kind, array in arrays.items():
            write_array(shards_dir / shard_file_name(shard_id, len(shards), kind), kind, array)
    special = SpecialTokens(
        schema=SPECIAL_TOKENS_SCHEMA,
        eos_id=EOS_ID,
        pad_id=PAD_ID,
        message_start_id=MESSAGE_START_ID,
        message_end_id=MESSAGE_END_ID,
        vocab_size=max(MESSAGE_END_ID + 1, next_id),
        control_tokens=[
            ControlToken(id=MESSAGE_START_ID, token=MESSAGE_START_TOKEN),
            ControlToken(id=MESSAGE_END_ID, token=MESSAGE_END_TOKEN),
        ],
        roles=registered_roles(set()),
        role_header_token_ids={name: list(ids) for name, ids in SYNTHETIC_LAYOUT.headers.items()},
        tokenizer=TokenizerInfo(  # no tokenizer file: readers show ids
            name="synthetic", file="", kind="synthetic", sha256="", base_vocab_size=32000
        ),
    )
    (Path(data_dir) / SPECIAL_TOKENS_FILE).write_bytes(msgspec.json.encode(special))
