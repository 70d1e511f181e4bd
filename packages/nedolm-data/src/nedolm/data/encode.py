"""Encoding: chunks of input lines → parsed, tokenized documents laid out by the renderer.

Chunks are parsed and encoded in-process (a ``tokenizers`` or ``sentencepiece`` batch encode
already uses every core; one thread tokenizes the next chunk while this one lays out documents)
or in a pool of worker processes (``--workers``). Either way results come back in input order,
so the corpus is the same whatever the number of workers. Reading records is ``inputs``'s job
(``read_records``: JSON lines, ShareGPT, Parquet, ``datasets``), parsing them ``sources``'s
(``parse_record``): a new input format plugs in there.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import multiprocessing
import multiprocessing.pool
import os
import sys
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nedolm.data.build_options import BuildOptions
from nedolm.data.format import SpecialTokens
from nedolm.data.inputs import input_size, read_records
from nedolm.data.lossless import SPACE_MARK
from nedolm.data.packing import (
    DROP_HARD_CONTINUATION,
    DROP_MESSAGE_TOO_LONG,
    document_drop_reason,
)
from nedolm.data.records import ROLE_NAMES, target_tokens, token_dtype
from nedolm.data.render import ConversationLayout, message_segments
from nedolm.data.sources import (
    EMPTY_CONTENT,
    SPECIAL_TOKEN_IN_CONTENT,
    UNKNOWN_TOKEN,
    Conversation,
    RecordPolicy,
    Rejected,
    SourceLabel,
    parse_record,
)
from nedolm.data.tokenizer import TextTokenizer, content_forbidden_ids, load_tokenizer

Lines = list[tuple[int, bytes | Rejected]]
"""(record number, record JSON or the reader's rejection) of one chunk of an input."""


@dataclass
class EncodedDocument:
    line: int
    doc_key: int
    tokens: np.ndarray
    segments: np.ndarray
    content_lengths: np.ndarray  # <u4, one per message: digest input, straight from the encoder
    content: np.ndarray  # <u4, every message's content ids concatenated
    conversation_key: int  # digest of the laid-out document: exact duplicates share it
    unk_target_tokens: int  # <unk> ids inside trainable content
    lost_characters: int  # content characters that encode → decode does not give back
    characters: int  # content characters in all (what lost_characters is a share of)
    target_tokens: int = 0  # assistant targets (what a drop of a document would lose)


Encoded = EncodedDocument | Rejected


class ChunkEncoder:
    """Parses and encodes one chunk of lines into documents laid out as SPEC §2 says."""

    def __init__(
        self, tokenizer: TextTokenizer, specials: SpecialTokens, policy: RecordPolicy, seq_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.specials = specials
        self.policy = policy
        self.seq_len = seq_len
        self.layout = ConversationLayout.from_specials(specials)
        self.forbidden = content_forbidden_ids(tokenizer, specials)
        self.header_len = np.array([len(self.layout.headers[name]) for name in ROLE_NAMES])
        self.dtype = token_dtype(specials.vocab_size)

    def encode(self, source: SourceLabel, lines: Lines) -> list[Encoded]:
        parsed = self.parse(source, lines)
        return self.assemble(source, lines, parsed, self.tokenize(parsed))

    def parse(self, source: SourceLabel, lines: Lines) -> list[Conversation | Rejected]:
        return [
            raw
            if isinstance(raw, Rejected)
            else parse_record(raw, source.name, line, self.policy, source.where(line))
            for line, raw in lines
        ]

    def tokenize(self, parsed: Sequence[Conversation | Rejected]) -> Tokenized:
        """Content ids of every message of the chunk's conversations, and how many of each
        message's characters the round trip loses (the tokenizer releases the GIL)."""
        texts = [m.text for c in parsed if isinstance(c, Conversation) for m in c.messages]
        ids = self.tokenizer.encode_batch(texts)
        if not self.tokenizer.lossless:
            return Tokenized(ids, lost_characters(texts, self.tokenizer.decode_batch(ids)))
        # Only a text holding the space mark can change (nedolm.data.lossless): decode those.
        lost = [0] * len(texts)
        marked = [i for i, text in enumerate(texts) if SPACE_MARK in text]
        if marked:
            back = self.tokenizer.decode_batch([ids[i] for i in marked])
            counts = lost_characters([texts[i] for i in marked], back)
            for i, n in zip(marked, counts, strict=True):
                lost[i] = n
        return Tokenized(ids, lost)

    def assemble(
        self,
        source: SourceLabel,
        lines: Lines,
        parsed: Sequence[Conversation | Rejected],
        tokenized: Tokenized,
    ) -> list[Encoded]:
        contents, lost = iter(tokenized.ids), iter(tokenized.lost)
        results: list[Encoded] = []
        for (line, _), record in zip(lines, parsed, strict=True):
            if isinstance(record, Rejected):
                results.append(record)
            else:
                messages = [next(contents) for _ in record.messages]
                lost_here = sum(next(lost) for _ in record.messages)
                results.append(
                    self._document(source.where(line), line, record, messages, lost_here)
                )
        return results

    def _document(
        self,
        where: str,
        line: int,
        conv: Conversation,
        contents: list[list[int]],
        lost: int,
    ) -> Encoded:
        rejected = content_rejection(where, contents, self.forbidden) or self._unknown(
            where, contents
        )
        if rejected is not None:
            return rejected
        roles = np.array([m.role for m in conv.messages], np.int64)
        content_len = np.array([len(c) for c in contents], np.int64)
        segments = message_segments(
            np.array([len(roles)]),
            roles,
            self.header_len[roles],
            content_len,
            np.array([m.trainable for m in conv.messages], bool),
        )
        reason = document_drop_reason(segments, self.seq_len)
        if reason is not None:
            return planner_rejection(where, reason, segments, self.seq_len)
        tokens = np.array(
            self.layout.document([ROLE_NAMES[m.role] for m in conv.messages], contents), self.dtype
        )
        digest = hashlib.blake2b(tokens.tobytes(), digest_size=8)
        digest.update(segments.tobytes())  # the same tokens trained differently differ
        unk = self.tokenizer.unk_id
        return EncodedDocument(
            line=line,
            doc_key=conv.doc_key,
            tokens=tokens,
            segments=segments,
            content_lengths=content_len.astype("<u4"),
            content=np.fromiter(itertools.chain.from_iterable(contents), "<u4"),
            conversation_key=int.from_bytes(digest.digest(), "little"),
            unk_target_tokens=sum(
                c.count(unk) for c, m in zip(contents, conv.messages, strict=True) if m.trainable
            ),
            lost_characters=lost,
            characters=sum(len(m.text) for m in conv.messages),
            target_tokens=target_tokens(segments),
        )

    def _unknown(self, where: str, contents: list[list[int]]) -> Rejected | None:
        """Content holding ``<unk>`` ids, unless the policy keeps (and counts) them."""
        unk = self.tokenizer.unk_id
        if self.policy.unknown_tokens == "keep" or unk is None:
            return None
        for i, content in enumerate(contents):
            if unk in content:
                return Rejected(
                    UNKNOWN_TOKEN,
                    f"{where}: messages[{i}] holds {content.count(unk)} <unk> ids (characters"
                    " outside the tokenizer's vocabulary); --unknown-tokens keep counts them",
                )
        return None


def planner_rejection(where: str, reason: str, segments: np.ndarray, seq_len: int) -> Rejected:
    """The drop of a document no window plan can use, saying which message and how long."""
    lengths = segments["length"].astype(np.int64)
    if reason == DROP_HARD_CONTINUATION:
        lengths = np.where(segments["trainable"] != 0, lengths, 0)
    if reason not in (DROP_HARD_CONTINUATION, DROP_MESSAGE_TOO_LONG):
        return Rejected(reason, f"{where}: no assistant message is a target")
    i = int(np.argmax(lengths))  # the longest (its index may differ from the record's, e.g.
    role = ROLE_NAMES[int(segments["role"][i])]  # after a system message added for tools)
    return Rejected(
        reason,
        f"{where}: a message ({role}) of {lengths[i]} tokens, more than a --seq-len {seq_len}"
        f" window holds ({seq_len + 1})",
        tokens=int(lengths[i]),
        target_tokens=target_tokens(segments),
    )


@dataclass
class Tokenized:
    ids: list[list[int]]  # content ids per message
    lost: list[int]  # per message: characters the encode → decode round trip loses


def lost_characters(texts: Sequence[str], decoded: Sequence[str]) -> list[int]:
    """Per text, the characters missing from its decoding, counted as a multiset: a dropped
    newline or an unknown character counts 1, a reordering nothing."""
    return [
        0 if text == back else (Counter(text) - Counter(back)).total()
        for text, back in zip(texts, decoded, strict=True)
    ]


def content_rejection(
    where: str, contents: Sequence[Sequence[int]], forbidden: set[int]
) -> Rejected | None:
    """Content that encodes to no tokens is empty (an assistant message would train only its
    end token); content holding a special id would smuggle a control token into the text."""
    for i, content in enumerate(contents):
        if not content:
            return Rejected(EMPTY_CONTENT, f"{where}: messages[{i}]: content encodes to no tokens")
        special = forbidden.intersection(content)
        if special:
            return Rejected(
                SPECIAL_TOKEN_IN_CONTENT,
                f"{where}: messages[{i}] encodes to the special id {min(special)} (typed text"
                " such as '<s>' that this tokenizer reads as its special token)",
            )
    return None


def encoded_chunks(
    paths: Sequence[Path],
    names: Sequence[SourceLabel],
    encoder: ChunkEncoder,
    options: BuildOptions,
    on_bytes: Callable[[int], None] = lambda _: None,
) -> Iterator[tuple[int, list[Encoded]]]:
    """(source, results) per chunk, in input order, at most 2*workers chunks in flight.

    ``names[i]`` names input ``i`` in keys and messages (``inputs.source_labels``); ``on_bytes`` gets the bytes read so far
    over all inputs (``inputs.input_size`` units), for a progress bar.
    """
    chunks = _chunks(paths, names, options, on_bytes)
    if options.workers == 1:
        yield from _pipelined(chunks, names, encoder)
        return
    init = (encoder.tokenizer.path, encoder.specials, options.policy, options.seq_len)
    with _worker_pool(options.workers, init) as pool:
        pending: deque = deque()
        for source, lines in chunks:
            pending.append((source, pool.apply_async(_encode_in_worker, (names[source], lines))))
            if len(pending) >= 2 * options.workers:
                source_done, result = pending.popleft()
                yield source_done, result.get()
        while pending:
            source_done, result = pending.popleft()
            yield source_done, result.get()


def _chunks(
    paths: Sequence[Path],
    names: Sequence[SourceLabel],
    options: BuildOptions,
    on_bytes: Callable[[int], None],
) -> Iterator[tuple[int, Lines]]:
    done = 0
    for source, path in enumerate(paths):
        records = read_records(
            path,
            options.input_format,
            options.messages_field,
            on_progress=lambda n, before=done: on_bytes(before + n),
            name=names[source].name,
            max_line_bytes=options.max_line_bytes,
        )
        while chunk := list(itertools.islice(records, options.chunk_records)):
            yield source, chunk
        done += input_size(path)


def _pipelined(
    chunks: Iterator[tuple[int, Lines]], names: Sequence[SourceLabel], encoder: ChunkEncoder
) -> Iterator[tuple[int, list[Encoded]]]:
    """In-process encoding overlapped with Python work: one thread runs the tokenizer on the
    next chunk (the tokenizer releases the GIL) while this one parses and lays out documents."""
    with ThreadPoolExecutor(max_workers=1) as tokenizer_thread:
        pending: deque = deque()
        for source, lines in chunks:
            parsed = encoder.parse(names[source], lines)
            pending.append(
                (source, lines, parsed, tokenizer_thread.submit(encoder.tokenize, parsed))
            )
            if len(pending) > 1:
                yield _assembled(pending.popleft(), names, encoder)
        while pending:
            yield _assembled(pending.popleft(), names, encoder)


def _assembled(
    item: tuple, names: Sequence[SourceLabel], encoder: ChunkEncoder
) -> tuple[int, list[Encoded]]:
    source, lines, parsed, ids = item
    return source, encoder.assemble(names[source], lines, parsed, ids.result())


_WORKER: ChunkEncoder | None = None


def _init_worker(
    tokenizer_path: Path, specials: SpecialTokens, policy: RecordPolicy, seq_len: int
) -> None:
    global _WORKER
    _WORKER = ChunkEncoder(load_tokenizer(tokenizer_path), specials, policy, seq_len)


@contextlib.contextmanager
def _worker_pool(workers: int, init: tuple) -> Iterator[multiprocessing.pool.Pool]:
    """A pool of encoding processes, each with its own tokenizer.

    Fork on Linux: spawned children would re-import the caller's ``__main__`` (for the CLI,
    the whole app and torch: ~10 s each). ``TOKENIZERS_PARALLELISM=false`` while forking keeps
    the children single-threaded and silences the library's fork warning.
    """
    method = "fork" if sys.platform == "linux" else "spawn"
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = multiprocessing.get_context(method).Pool(workers, _init_worker, init)
    finally:
        if saved is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    with pool:
        yield pool


def _encode_in_worker(source: SourceLabel, lines: Lines) -> list[Encoded]:
    assert _WORKER is not None
    return _WORKER.encode(source, lines)
