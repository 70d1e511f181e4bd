"""The corpus builder: chat records (``inputs``) + a tokenizer → a verified DATA_DIR (SPEC §2).

``build_corpus`` runs the stages: encode (``encode``: parse, tokenize, lay out documents with
the renderer), write shards (``shards``), verify and write the contract, install (``install``).
Records stream through in chunks, so memory is bounded by the chunk size and the number of
chunks in flight, whatever the input size (plus two digests per document, ~200 bytes, to refuse
repeated record ids and to count exact duplicate conversations). Results are consumed in input order, so the output is
byte-identical for the same inputs and options, whatever the number of workers.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
from tqdm import tqdm

from nedolm.data.build_options import BuildError, BuildOptions
from nedolm.data.contract import (
    BuildProvenance,
    SourceEntry,
    dump_json,
    manifest_document,
    write_contract,
)
from nedolm.data.drops import DropShare, check_drop_fraction, drop_share
from nedolm.data.encode import ChunkEncoder, EncodedDocument, encoded_chunks
from nedolm.data.format import SHARDS_DIR, SPECIAL_TOKENS_FILE
from nedolm.data.inputs import input_sha256, input_size, read_records, source_labels
from nedolm.data.install import check_out, check_out_corpus, fresh_tmp_dir, install
from nedolm.data.mixture import copies_per_conversation, copy_key, mixture_counts
from nedolm.data.packing import (
    DROP_HARD_CONTINUATION,
    DROP_MESSAGE_TOO_LONG,
    DROP_NO_TARGET,
)
from nedolm.data.records import token_dtype
from nedolm.data.shards import ShardSink
from nedolm.data.sources import (
    DUPLICATE_CONVERSATION,
    DUPLICATE_RECORD,
    BadRecordError,
    Rejected,
    SourceLabel,
)
from nedolm.data.tokenizer import (
    build_special_tokens,
    copy_tokenizer_files,
    load_tokenizer,
    registered_special_tokens,
)
from nedolm.data.verify import verify_corpus

__all__ = ["BuildError", "BuildOptions", "BuildReport", "SourceReport", "build_corpus"]

TOKENIZER_DIR = "tokenizer"
PLANNER_DROPS = (DROP_NO_TARGET, DROP_MESSAGE_TOO_LONG, DROP_HARD_CONTINUATION)
"""Documents the plan cannot use: always dropped and counted, never an error (SPEC §2)."""
NEVER_AN_ERROR = frozenset({*PLANNER_DROPS, DUPLICATE_CONVERSATION})
"""Drop reasons that no policy turns into an error (``--dedup`` asks for the last one)."""
DROP_EXAMPLES = 20
"""Dropped records quoted per reason in the report (their messages start with ``file:line``)."""


SourceReport = SourceEntry
"""One input file's accounting, as the manifest's build block records it."""


class BuildReport(msgspec.Struct, frozen=True):
    out: str
    sources: list[SourceReport]
    shards: int
    validation_shard_ids: list[int]
    documents: int
    tokens: int
    identical_rebuild: bool  # ``out`` already held exactly this corpus; nothing changed
    drop_examples: dict[str, list[str]] = {}  # reason -> up to DROP_EXAMPLES messages
    drop_longest: dict[str, int] = {}  # message_too_long, hard_continuation -> longest, tokens
    content_characters: int = 0  # characters of the kept content (lost_characters' whole)
    usable_target_tokens: int = 0  # assistant targets of the usable records (before a mixture)
    dropped_target_tokens: int = 0  # assistant targets of the dropped records that were tokenized

    @property
    def records(self) -> int:
        return sum(s.records for s in self.sources)

    @property
    def drop_share(self) -> DropShare:
        """The share of the records and targets lost (``drops``)."""
        return drop_share(self.sources, self.usable_target_tokens, self.dropped_target_tokens)

    @property
    def dropped(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for source in self.sources:
            total.update(source.dropped)
        return dict(sorted(total.items()))


def build_corpus(
    inputs: Sequence[Path],
    tokenizer_path: Path,
    out: Path,
    options: BuildOptions,
    *,
    val_inputs: Sequence[Path] = (),
    progress: bool = False,
) -> BuildReport:
    """Build ``out`` from chat ``inputs`` (files or ``datasets`` directories, read as
    ``options.input_format``); see the module docstring for the guarantees.

    ``options.weights`` mix the ``inputs`` (``mixture``). Each of ``val_inputs`` becomes one
    validation shard of its own, after the training shards, instead of shards held out of
    ``inputs``; the manifest names the input of each (``SourceEntry.validation_shard``).

    Raises:
        BadRecordError: a bad record while the policy says "error" (names file and line).
        InputError: an input that cannot be read (a cut compressed stream, a broken array).
        BuildError: empty inputs, nothing kept, too few documents for the shards, or an
            ``out`` that holds something else, a validation input without a document, or
            more dropped than ``options.max_drop_fraction``.
        TokenizerError: the tokenizer cannot be loaded.
    """
    train_paths = [Path(p) for p in inputs]
    paths = train_paths + [Path(p) for p in val_inputs]
    _check_inputs(paths, options)
    if options.weights and len(options.weights) != len(train_paths):
        raise BuildError(f"{len(options.weights)} mixture weights for {len(train_paths)} inputs")
    if val_inputs and not options.default_split:
        raise BuildError("give either validation inputs or --val-shards/--val-fraction, not both")
    out = Path(out)
    check_out(out)
    if options.round_robin_shards is not None and not val_inputs:  # refuse bad ids before the
        options.validation_ids(options.round_robin_shards)  # work (the count is an upper bound)
    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer_file = f"{TOKENIZER_DIR}/{tokenizer.name}"
    specials = build_special_tokens(tokenizer, tokenizer_file)
    check_out_corpus(out, paths, specials.tokenizer.sha256, options.seq_len, options.overwrite)
    encoder = ChunkEncoder(tokenizer, specials, options.policy, options.seq_len)

    tmp = fresh_tmp_dir(out, SHARDS_DIR, TOKENIZER_DIR)
    try:
        copy_tokenizer_files(tokenizer, tmp / TOKENIZER_DIR)
        dtype = token_dtype(specials.vocab_size)
        sink = ShardSink(tmp / SHARDS_DIR, options, dtype, validation_shards=len(val_inputs))
        stream = _Stream(paths, len(train_paths), encoder, options, progress)
        streamed, digests = _write_shards(stream, sink)
        sources = _place_validation(streamed.sources, sink.training_shards)
        check_drop_fraction(
            drop_share(sources, streamed.usable_target_tokens, streamed.dropped_target_tokens),
            options.max_drop_fraction,
            options.seq_len,
            streamed.drop_longest,
        )
        registered = registered_special_tokens(specials, streamed.role_codes)
        (tmp / SPECIAL_TOKENS_FILE).write_bytes(dump_json(msgspec.to_builtins(registered)))
        if val_inputs:
            validation_ids = list(range(sink.training_shards, len(digests)))
        else:
            validation_ids = options.validation_ids(len(digests))
        result = verify_corpus(tmp, options.seq_len, content_sha256=digests, tokenizer=tokenizer)
        if result.problems:
            raise BuildError("the built corpus failed verification:\n" + "\n".join(result.problems))
        build_block = BuildProvenance(sources, digests, specials.tokenizer.sha256)
        manifest = manifest_document(result.files, validation_ids, build_block)
        write_contract(tmp, result.report, result.audit, manifest)
        identical = install(tmp, out, options.overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return BuildReport(
        out=str(out),
        sources=sources,
        shards=len(digests),
        validation_shard_ids=validation_ids,
        documents=result.report.documents,
        tokens=result.report.tokens_including_eos,
        identical_rebuild=identical,
        drop_examples=streamed.drop_examples,
        drop_longest=streamed.drop_longest,
        content_characters=streamed.content_characters,
        usable_target_tokens=streamed.usable_target_tokens,
        dropped_target_tokens=streamed.dropped_target_tokens,
    )


def _place_validation(sources: list[SourceReport], first: int) -> list[SourceReport]:
    """The validation inputs' shard ids: they follow the ``first`` training shards."""
    return [
        s
        if s.validation_shard is None
        else msgspec.structs.replace(s, validation_shard=first + s.validation_shard)
        for s in sources
    ]


class _Streamed(msgspec.Struct):
    """What streaming the inputs found besides the documents."""

    sources: list[SourceReport]
    role_codes: set[int]  # roles of the kept messages: which ones SPECIAL_TOKENS.json registers
    drop_examples: dict[str, list[str]]
    drop_longest: dict[str, int]
    content_characters: int
    usable_target_tokens: int
    dropped_target_tokens: int


def _write_shards(stream: _Stream, sink: ShardSink) -> tuple[_Streamed, list[str]]:
    """Encode every input into ``sink``; the per-source accounting and the shard digests.

    A mixture streams the inputs twice: once to count each input's usable conversations, then
    to write the copies the mixture draws from them (``mixture``).
    """
    try:
        copies = None
        if stream.options.weights:
            counted = stream.run(None, None)
            usable = [s.kept for s in counted.sources[: stream.training]]
            copies = _mixture_copies(stream, usable)
        return stream.run(sink, copies), sink.finish()
    except BaseException:
        sink.abort()
        raise


def _mixture_copies(stream: _Stream, usable: list[int]) -> list[np.ndarray]:
    """Copies of each usable conversation per weighted input (``mixture``)."""
    options = stream.options
    wanted = mixture_counts(options.weights, options.mix_total or sum(usable))
    copies = []
    for source, (have, want) in enumerate(zip(usable, wanted, strict=True)):
        try:
            copies.append(copies_per_conversation(have, want, options.seed, source))
        except BuildError as exc:
            raise BuildError(f"{stream.names[source].name}: {exc}") from None
    return copies


class _Stream:
    """One pass over the inputs: the documents to a sink, the accounting per source."""

    def __init__(
        self,
        paths: Sequence[Path],
        training: int,
        encoder: ChunkEncoder,
        options: BuildOptions,
        progress: bool,
    ) -> None:
        self.paths, self.training = paths, training  # inputs from ``training`` on: validation
        self.encoder, self.options, self.progress = encoder, options, progress
        self.names = source_labels(paths, options.input_format)

    def run(self, sink: ShardSink | None, copies: Sequence[np.ndarray] | None) -> _Streamed:
        """Stream every input; ``copies[source][i]``: how often to write the ``i``-th usable
        conversation of a training input (None: once). Without a sink only counts."""
        paths, names, options = self.paths, self.names, self.options
        tally = [_SourceTally() for _ in paths]
        examples: dict[str, list[str]] = {}
        longest: Counter[str] = Counter()
        characters = 0
        role_codes: set[int] = set()
        seen: dict[int, str] = {}  # record key -> where it was first kept
        conversations: dict[int, str] = {}  # laid-out conversation digest -> where first kept
        total_bytes = sum(input_size(p) for p in paths)
        with tqdm(
            total=total_bytes, unit="B", unit_scale=True, disable=not self.progress, desc="prepare"
        ) as bar:
            chunks = encoded_chunks(
                paths, names, self.encoder, options, lambda n: bar.update(n - bar.n)
            )
            for source, results in chunks:
                counts = tally[source]
                for result in results:
                    counts.records += 1
                    if isinstance(result, EncodedDocument):
                        result = _unique(
                            result, names[source], seen, conversations, counts, options
                        )
                    if isinstance(result, Rejected):
                        if result.reason not in NEVER_AN_ERROR and options.policy.stops_on(
                            result.reason
                        ):
                            raise BadRecordError(result.reason, result.message)
                        counts.dropped[result.reason] += 1
                        counts.dropped_target_tokens += result.target_tokens
                        if result.tokens > longest[result.reason]:
                            longest[result.reason] = result.tokens
                        quoted = examples.setdefault(result.reason, [])
                        if len(quoted) < DROP_EXAMPLES:
                            quoted.append(result.message)
                        continue
                    where = names[source].where(result.line)
                    seen[result.doc_key] = where
                    conversations.setdefault(result.conversation_key, where)
                    counts.usable_target_tokens += result.target_tokens
                    usable, counts.usable = counts.usable, counts.usable + 1
                    written = (
                        1 if copies is None or source >= self.training else copies[source][usable]
                    )
                    if written == 0:
                        counts.left_out += 1
                        continue
                    if sink is not None:
                        self._write(sink, source, result, int(written))
                    role_codes.update(result.segments["role"].tolist())
                    counts.kept += 1
                    counts.repeated += int(written) - 1
                    counts.unk_target_tokens += result.unk_target_tokens
                    counts.lost_characters += result.lost_characters
                    characters += result.characters
                bar.set_postfix(records=sum(t.records for t in tally), refresh=False)
        self._check_kept(tally)
        return _Streamed(
            self._entries(tally, copies is not None),
            role_codes,
            dict(sorted(examples.items())),
            dict(sorted(longest.items())),
            characters,
            sum(t.usable_target_tokens for t in tally),
            sum(t.dropped_target_tokens for t in tally),
        )

    def _write(self, sink: ShardSink, source: int, doc: EncodedDocument, copies: int) -> None:
        """``doc`` and its extra copies, each under a key of its own."""
        for copy in range(copies):
            copied = dataclasses.replace(doc, doc_key=copy_key(doc.doc_key, copy)) if copy else doc
            if source >= self.training:
                sink.add_validation(copied, source - self.training)
            else:
                sink.add(copied)

    def _check_kept(self, tally: list[_SourceTally]) -> None:
        if not any(t.kept for t in tally[: self.training]):
            dropped = sum((t.dropped for t in tally), Counter())
            raise BuildError(f"no document was kept; see the drop reasons: {dropped}")
        for name, counts in zip(self.names[self.training :], tally[self.training :], strict=True):
            if not counts.kept:
                raise BuildError(
                    f"{name.name}: the validation input kept no document (dropped:"
                    f" {dict(counts.dropped)})"
                )

    def _entries(self, tally: list[_SourceTally], mixed: bool) -> list[SourceReport]:
        entries = []
        for i, (name, path, counts) in enumerate(zip(self.names, self.paths, tally, strict=True)):
            entry = counts.entry(name.name, input_sha256(path))
            if i >= self.training:  # the k-th validation shard (``_place_validation``)
                entry = msgspec.structs.replace(entry, validation_shard=i - self.training)
            elif mixed:
                entry = msgspec.structs.replace(entry, weight=self.options.weights[i])
            entries.append(entry)
        return entries


@dataclass
class _SourceTally:
    records: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    unk_target_tokens: int = 0
    lost_characters: int = 0
    duplicate_conversations: int = 0
    usable: int = 0  # conversations the build could use (kept + left_out)
    left_out: int = 0
    repeated: int = 0
    usable_target_tokens: int = 0
    dropped_target_tokens: int = 0

    def entry(self, name: str, sha256: str) -> SourceReport:
        return SourceReport(
            name=name,
            sha256=sha256,
            records=self.records,
            kept=self.kept,
            dropped=dict(sorted(self.dropped.items())),
            unk_target_tokens=self.unk_target_tokens,
            lost_characters=self.lost_characters,
            duplicate_conversations=self.duplicate_conversations,
            left_out=self.left_out,
            repeated=self.repeated,
        )


def _unique(
    document: EncodedDocument,
    source: SourceLabel,
    seen: dict[int, str],
    conversations: dict[int, str],
    counts: _SourceTally,
    options: BuildOptions,
) -> EncodedDocument | Rejected:
    """The document, or why it repeats an earlier one: a record id seen before is refused (or
    dropped), an identical conversation is counted and, under ``dedup``, dropped."""
    where = source.where(document.line)
    if document.doc_key in seen:
        return Rejected(DUPLICATE_RECORD, f"{where}: same record id as {seen[document.doc_key]}")
    first = conversations.get(document.conversation_key)
    if first is None:
        return document
    counts.duplicate_conversations += 1
    if options.dedup:
        return Rejected(DUPLICATE_CONVERSATION, f"{where}: same conversation as {first}")
    return document


def _check_inputs(paths: Sequence[Path], options: BuildOptions) -> None:
    """Refuse a missing, unreadable or empty input before any work (the message names it)."""
    if not paths:
        raise BuildError("no input files given")
    for path in paths:
        if not path.exists():
            raise BuildError(f"{path}: input file not found")
        records = read_records(
            path,
            options.input_format,
            options.messages_field,
            max_line_bytes=options.max_line_bytes,
        )
        if next(records, None) is None:
            raise BuildError(f"{path}: holds no records")
