"""The corpus builder: chat JSONL + a tokenizer → a verified DATA_DIR (SPEC §2).

Records stream through in chunks, so memory is bounded by the chunk size and the number of
chunks in flight, whatever the input size (plus one set of document keys, ~100 bytes per
document, to refuse duplicates). Chunks are parsed and encoded in-process (a ``tokenizers`` or
``sentencepiece`` batch encode already uses every core) or in a pool of worker processes
(``--workers``); results are consumed in input order, so the output is byte-identical for the
same inputs and options, whatever the number of workers. Everything is written into a temporary directory next to ``out`` and
renamed into place only after the verifier passed: a crash never leaves a corpus that looks
valid.
"""

from __future__ import annotations

import contextlib
import filecmp
import itertools
import math
import multiprocessing
import multiprocessing.pool
import os
import resource
import shutil
import sys
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
from tqdm import tqdm

from nedolm.data.contract import (
    SHARD_MANIFEST_FILE,
    dump_json,
    manifest_document,
    write_contract,
)
from nedolm.data.format import (
    KINDS,
    SHARDS_DIR,
    SPECIAL_TOKENS_FILE,
    ArrayWriter,
    SpecialTokens,
    shard_file_name,
)
from nedolm.data.hashing import ContentDigest, file_sha256
from nedolm.data.packing import (
    DROP_HARD_CONTINUATION,
    DROP_MESSAGE_TOO_LONG,
    DROP_NO_TARGET,
    document_drop_reason,
)
from nedolm.data.records import INDEX_DTYPE, ROLE_NAMES, SEGMENT_DTYPE, token_dtype
from nedolm.data.sources import (
    DUPLICATE_RECORD,
    SPECIAL_TOKEN_IN_CONTENT,
    Conversation,
    InputError,
    RecordPolicy,
    Rejected,
    iter_lines,
    parse_record,
)
from nedolm.data.tokenizer import (
    TextTokenizer,
    build_special_tokens,
    copy_tokenizer_files,
    load_tokenizer,
)
from nedolm.data.verify import verify_corpus

TOKENIZER_DIR = "tokenizer"
PLANNER_DROPS = (DROP_NO_TARGET, DROP_MESSAGE_TOO_LONG, DROP_HARD_CONTINUATION)
"""Documents the plan cannot use: always dropped and counted, never an error (SPEC §2)."""


class BuildError(RuntimeError):
    """The build cannot produce a corpus (bad options, nothing kept, an occupied ``out``)."""


@dataclass(frozen=True)
class BuildOptions:
    """How to turn inputs into shards; the same options give byte-identical output."""

    seq_len: int  # the packing audit is computed for this context length
    shards: int | None = None  # N shards, documents dealt round-robin in input order
    shard_tokens: int | None = None  # or: fill shards in order up to this many tokens each
    val_shards: tuple[int, ...] = ()  # shard ids held out for validation
    val_fraction: float | None = None  # or: hold out the last ceil(fraction * N) shards
    policy: RecordPolicy = field(default_factory=RecordPolicy)
    workers: int = 1  # 1: encode in this process; >1: a pool of processes
    chunk_records: int = 256
    overwrite: bool = False  # replace an ``out`` that holds a different corpus

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise BuildError(f"--seq-len must be positive, not {self.seq_len}")
        if self.shards is not None and self.shard_tokens is not None:
            raise BuildError("give either --shards or --shard-tokens, not both")
        if self.shards is not None and self.shards < 1:
            raise BuildError(f"--shards must be at least 1, not {self.shards}")
        if self.shard_tokens is not None and self.shard_tokens < 1:
            raise BuildError(f"--shard-tokens must be positive, not {self.shard_tokens}")
        if self.val_shards and self.val_fraction is not None:
            raise BuildError("give either --val-shards or --val-fraction, not both")
        if self.val_fraction is not None and not 0 < self.val_fraction < 1:
            raise BuildError(f"--val-fraction must be in (0, 1), not {self.val_fraction}")
        if self.workers < 1 or self.chunk_records < 1:
            raise BuildError("--workers and the chunk size must be at least 1")

    @property
    def shard_count(self) -> int | None:
        """Known before the build unless shards are filled up to ``shard_tokens``."""
        return None if self.shard_tokens is not None else (self.shards or 1)

    def validation_ids(self, num_shards: int) -> list[int]:
        ids = sorted(set(self.val_shards))
        if self.val_fraction is not None:
            count = math.ceil(self.val_fraction * num_shards)
            ids = list(range(num_shards - count, num_shards))
        if any(not 0 <= i < num_shards for i in ids):
            raise BuildError(f"validation shard ids {ids} outside 0..{num_shards - 1}")
        if ids and len(ids) >= num_shards:
            raise BuildError(f"validation takes all {num_shards} shards; none left to train on")
        return ids


class SourceReport(msgspec.Struct, frozen=True):
    """One input file's accounting: ``records == kept + sum(dropped.values())``."""

    name: str
    sha256: str
    records: int
    kept: int
    dropped: dict[str, int]


class BuildReport(msgspec.Struct, frozen=True):
    out: str
    sources: list[SourceReport]
    shards: int
    validation_shard_ids: list[int]
    documents: int
    tokens: int
    identical_rebuild: bool  # ``out`` already held exactly this corpus; nothing changed

    @property
    def records(self) -> int:
        return sum(s.records for s in self.sources)

    @property
    def dropped(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for source in self.sources:
            total.update(source.dropped)
        return dict(sorted(total.items()))


# --- encoding (runs in worker processes or in-process) ---------------------------------------


@dataclass
class _Kept:
    line: int
    doc_key: int
    tokens: np.ndarray
    segments: np.ndarray
    content_lengths: np.ndarray  # <u4, one per message: digest input, straight from the encoder
    content: np.ndarray  # <u4, every message's content ids concatenated


class ChunkEncoder:
    """Parses and encodes one chunk of lines into documents laid out as SPEC §2 says."""

    def __init__(
        self, tokenizer: TextTokenizer, specials: SpecialTokens, policy: RecordPolicy, seq_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.specials = specials
        self.policy = policy
        self.seq_len = seq_len
        self.start_id = specials.message_start_id
        self.end_id = specials.message_end_id
        self.eos_id = specials.eos_id
        self.forbidden = {specials.eos_id, specials.pad_id}
        self.headers = [specials.role_header_token_ids[name] for name in ROLE_NAMES]
        self.dtype = token_dtype(specials.vocab_size)

    def encode(
        self, source_name: str, lines: Sequence[tuple[int, bytes]]
    ) -> list[_Kept | Rejected]:
        parsed = self.parse(source_name, lines)
        return self.assemble(source_name, lines, parsed, self.tokenize(parsed))

    def parse(
        self, source_name: str, lines: Sequence[tuple[int, bytes]]
    ) -> list[Conversation | Rejected]:
        return [parse_record(raw, source_name, line, self.policy) for line, raw in lines]

    def tokenize(self, parsed: Sequence[Conversation | Rejected]) -> list[list[int]]:
        """Content ids of every message of the chunk's conversations (releases the GIL)."""
        texts = [m.text for c in parsed if isinstance(c, Conversation) for m in c.messages]
        return self.tokenizer.encode_batch(texts)

    def assemble(
        self,
        source_name: str,
        lines: Sequence[tuple[int, bytes]],
        parsed: Sequence[Conversation | Rejected],
        ids: list[list[int]],
    ) -> list[_Kept | Rejected]:
        contents = iter(ids)
        results: list[_Kept | Rejected] = []
        for (line, _), record in zip(lines, parsed, strict=True):
            if isinstance(record, Rejected):
                results.append(record)
            else:
                messages = [next(contents) for _ in record.messages]
                results.append(self._document(source_name, line, record, messages))
        return results

    def _document(
        self, source_name: str, line: int, conv: Conversation, contents: list[list[int]]
    ) -> _Kept | Rejected:
        for i, content in enumerate(contents):
            if not self.forbidden.isdisjoint(content):
                return Rejected(
                    SPECIAL_TOKEN_IN_CONTENT,
                    f"{source_name}:{line}: messages[{i}] encodes to the EOS or pad id (text such"
                    " as '</s>' that this tokenizer turns into a special token)",
                )
        headers = [self.headers[m.role] for m in conv.messages]
        header_len = np.array([len(h) + 1 for h in headers], np.int64)
        content_len = np.array([len(c) for c in contents], np.int64)
        length = header_len + content_len + 1
        segments = np.empty(len(contents), SEGMENT_DTYPE)
        segments["start"] = np.cumsum(length) - length
        segments["length"] = length
        segments["header_len"] = header_len
        segments["role"] = [m.role for m in conv.messages]
        segments["trainable"] = [m.trainable for m in conv.messages]
        reason = document_drop_reason(segments, self.seq_len)
        if reason is not None:
            return Rejected(reason, f"{source_name}:{line}: dropped ({reason})")
        tokens: list[int] = []
        for header, content in zip(headers, contents, strict=True):
            tokens += [self.start_id, *header, *content, self.end_id]
        tokens.append(self.eos_id)
        return _Kept(
            line=line,
            doc_key=conv.doc_key,
            tokens=np.array(tokens, self.dtype),
            segments=segments,
            content_lengths=content_len.astype("<u4"),
            content=np.fromiter(itertools.chain.from_iterable(contents), "<u4"),
        )


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


def _encode_in_worker(source_name: str, lines: list[tuple[int, bytes]]) -> list[_Kept | Rejected]:
    assert _WORKER is not None
    return _WORKER.encode(source_name, lines)


# --- writing ---------------------------------------------------------------------------------


class _ShardWriter:
    """One shard's three files plus the digest of its content tokens."""

    def __init__(self, directory: Path, slot: int, dtype: np.dtype) -> None:
        base = directory / f"part-{slot:05d}"
        self.tokens = ArrayWriter(base.with_suffix(".tokens.bin"), "tokens", dtype)
        self.segments = ArrayWriter(base.with_suffix(".segments.bin"), "segments", SEGMENT_DTYPE)
        self.index = ArrayWriter(base.with_suffix(".index.bin"), "index", INDEX_DTYPE)
        self.digest = ContentDigest()
        self.closed = False

    def add(self, doc: _Kept) -> None:
        record = np.array(
            [
                (
                    doc.doc_key,
                    self.tokens.count,
                    self.segments.count,
                    len(doc.tokens),
                    len(doc.segments),
                )
            ],
            INDEX_DTYPE,
        )
        self.index.write(record)
        self.tokens.write(doc.tokens)
        self.segments.write(doc.segments)
        self.digest.update(doc.content_lengths, doc.content)

    @property
    def files(self) -> tuple[ArrayWriter, ArrayWriter, ArrayWriter]:
        return self.tokens, self.segments, self.index

    def close(self) -> None:
        if not self.closed:
            for writer in self.files:
                writer.close()
            self.closed = True

    def abort(self) -> None:
        for writer in self.files:
            writer.abort()


class _ShardSink:
    """Deals kept documents to shards: round-robin over N, or filled in order up to a size."""

    def __init__(self, directory: Path, options: BuildOptions, dtype: np.dtype) -> None:
        self.directory = directory
        self.dtype = dtype
        self.shard_tokens = options.shard_tokens
        count = options.shard_count or 1  # --shard-tokens: shards open one after the other
        _ensure_open_files(3 * count)
        self.writers = [_ShardWriter(directory, i, dtype) for i in range(count)]
        self.documents = 0

    def add(self, doc: _Kept) -> None:
        if self.shard_tokens is None:
            writer = self.writers[self.documents % len(self.writers)]
        else:
            writer = self.writers[-1]
            if writer.tokens.count >= self.shard_tokens:
                writer.close()
                writer = _ShardWriter(self.directory, len(self.writers), self.dtype)
                self.writers.append(writer)
        writer.add(doc)
        self.documents += 1

    def finish(self) -> list[str]:
        """Close every shard, give it its final name; return the content digests by shard."""
        if self.documents < len(self.writers):
            raise BuildError(
                f"only {self.documents} documents kept, fewer than the {len(self.writers)} shards"
            )
        total = len(self.writers)
        for slot, writer in enumerate(self.writers):
            writer.close()
            for kind, array_writer in zip(KINDS, writer.files, strict=True):
                os.replace(array_writer.path, self.directory / shard_file_name(slot, total, kind))
        return [w.digest.hexdigest() for w in self.writers]

    def abort(self) -> None:
        for writer in self.writers:
            writer.abort()


def _ensure_open_files(needed: int) -> None:
    """Round-robin keeps three files per shard open; raise the soft limit if that needs it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed + 256
    if want <= soft:
        return
    if hard != resource.RLIM_INFINITY and want > hard:
        raise BuildError(
            f"{needed // 3} shards need {want} open files but the limit is {hard};"
            " use fewer --shards or --shard-tokens"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


# --- the build -------------------------------------------------------------------------------


def _chunks(paths: Sequence[Path], size: int) -> Iterator[tuple[int, list[tuple[int, bytes]]]]:
    for source, path in enumerate(paths):
        chunk: list[tuple[int, bytes]] = []
        for item in iter_lines(path):
            chunk.append(item)
            if len(chunk) == size:
                yield source, chunk
                chunk = []
        if chunk:
            yield source, chunk


def _encoded_chunks(
    paths: Sequence[Path], encoder: ChunkEncoder, options: BuildOptions
) -> Iterator[tuple[int, int, list[_Kept | Rejected]]]:
    """(source, bytes read, results) per chunk, in input order, at most 2*workers in flight."""
    names = [p.name for p in paths]
    chunks = _chunks(paths, options.chunk_records)
    if options.workers == 1:
        yield from _pipelined(chunks, names, encoder)
        return
    init = (encoder.tokenizer.path, encoder.specials, options.policy, options.seq_len)
    with _worker_pool(options.workers, init) as pool:
        pending: deque = deque()
        for source, lines in chunks:
            pending.append(
                (
                    source,
                    sum(len(r) for _, r in lines),
                    pool.apply_async(_encode_in_worker, (names[source], lines)),
                )
            )
            if len(pending) >= 2 * options.workers:
                source_done, size, result = pending.popleft()
                yield source_done, size, result.get()
        while pending:
            source_done, size, result = pending.popleft()
            yield source_done, size, result.get()


def _pipelined(
    chunks: Iterator[tuple[int, list[tuple[int, bytes]]]], names: list[str], encoder: ChunkEncoder
) -> Iterator[tuple[int, int, list[_Kept | Rejected]]]:
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


def _assembled(item: tuple, names: list[str], encoder: ChunkEncoder) -> tuple[int, int, list]:
    source, lines, parsed, ids = item
    results = encoder.assemble(names[source], lines, parsed, ids.result())
    return source, sum(len(raw) for _, raw in lines), results


def build_corpus(
    inputs: Sequence[Path],
    tokenizer_path: Path,
    out: Path,
    options: BuildOptions,
    *,
    progress: bool = False,
) -> BuildReport:
    """Build ``out`` from chat JSONL ``inputs``; see the module docstring for the guarantees.

    Raises:
        InputError: a bad record while the policy says "error" (names file and line).
        BuildError: empty inputs, nothing kept, too few documents for the shards, or an
            ``out`` that holds something else.
        TokenizerError: the tokenizer cannot be loaded.
    """
    paths = [Path(p) for p in inputs]
    _check_inputs(paths)
    out = Path(out)
    _check_out(out)
    if options.shard_count is not None:
        options.validation_ids(options.shard_count)  # refuse bad ids before the work
    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer_file = f"{TOKENIZER_DIR}/{tokenizer.name}"
    specials = build_special_tokens(tokenizer, tokenizer_file)
    encoder = ChunkEncoder(tokenizer, specials, options.policy, options.seq_len)

    tmp = _fresh_tmp_dir(out)
    try:
        copy_tokenizer_files(tokenizer, tmp / TOKENIZER_DIR)
        (tmp / SPECIAL_TOKENS_FILE).write_bytes(dump_json(msgspec.to_builtins(specials)))
        sink = _ShardSink(tmp / SHARDS_DIR, options, token_dtype(specials.vocab_size))
        try:
            sources = _stream(paths, encoder, options, sink, progress)
            digests = sink.finish()
        except BaseException:
            sink.abort()
            raise
        validation_ids = options.validation_ids(len(digests))
        result = verify_corpus(tmp, options.seq_len, content_sha256=digests, tokenizer=tokenizer)
        if result.problems:
            raise BuildError("the built corpus failed verification:\n" + "\n".join(result.problems))
        build_block = {
            "sources": [msgspec.to_builtins(s) for s in sources],
            "content_sha256": digests,
            "tokenizer_sha256": specials.tokenizer.sha256,
        }
        manifest = manifest_document(result.files, validation_ids, build_block)
        write_contract(tmp, result.report, result.audit, manifest)
        identical = _install(tmp, out, options.overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return BuildReport(
        out=str(out),
        sources=sources,
        shards=len(digests),
        validation_shard_ids=validation_ids,
        documents=int(result.report["documents"]),
        tokens=int(result.report["tokens_including_eos"]),
        identical_rebuild=identical,
    )


def _stream(
    paths: Sequence[Path],
    encoder: ChunkEncoder,
    options: BuildOptions,
    sink: _ShardSink,
    progress: bool,
) -> list[SourceReport]:
    records = [0] * len(paths)
    kept = [0] * len(paths)
    dropped: list[Counter[str]] = [Counter() for _ in paths]
    seen: dict[int, str] = {}
    total_bytes = sum(p.stat().st_size for p in paths)
    with tqdm(
        total=total_bytes, unit="B", unit_scale=True, disable=not progress, desc="prepare"
    ) as bar:
        for source, size, results in _encoded_chunks(paths, encoder, options):
            for result in results:
                records[source] += 1
                if isinstance(result, _Kept) and result.doc_key in seen:
                    result = Rejected(
                        DUPLICATE_RECORD,
                        f"{paths[source].name}:{result.line}: same record id as {seen[result.doc_key]}",
                    )
                if isinstance(result, Rejected):
                    if result.reason not in PLANNER_DROPS and options.policy.stops_on(
                        result.reason
                    ):
                        raise InputError(result.message)
                    dropped[source][result.reason] += 1
                    continue
                seen[result.doc_key] = f"{paths[source].name}:{result.line}"
                sink.add(result)
                kept[source] += 1
            bar.update(size)
    if not sum(kept):
        raise BuildError(
            "no document was kept; see the drop reasons: " + str(sum(dropped, Counter()))
        )
    return [
        SourceReport(
            name=p.name, sha256=file_sha256(p), records=r, kept=k, dropped=dict(sorted(d.items()))
        )
        for p, r, k, d in zip(paths, records, kept, dropped, strict=True)
    ]


def _check_inputs(paths: Sequence[Path]) -> None:
    if not paths:
        raise BuildError("no input files given")
    for path in paths:
        if not path.is_file():
            raise BuildError(f"{path}: input file not found")
        if next(iter_lines(path), None) is None:
            raise BuildError(f"{path}: holds no records")


def _check_out(out: Path) -> None:
    """Refuse early what no rebuild could replace: a file, or a directory that is no corpus."""
    if out.exists() and not out.is_dir():
        raise BuildError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / SHARD_MANIFEST_FILE).exists():
        raise BuildError(f"{out}: exists, is not empty and holds no corpus; refusing to replace it")


def _fresh_tmp_dir(out: Path) -> Path:
    """``.<out>.tmp-<pid>`` beside ``out``; leftovers of dead builds are removed first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / SHARDS_DIR).mkdir(parents=True)
    (tmp / TOKENIZER_DIR).mkdir()
    return tmp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _install(tmp: Path, out: Path, overwrite: bool) -> bool:
    """Move the finished corpus to ``out``; True if ``out`` already held the same bytes."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.replace(tmp, out)
        _fsync_dir(out.parent)
        return False
    if _same_tree(tmp, out):
        shutil.rmtree(tmp)
        return True
    if not overwrite:
        raise BuildError(f"{out}: holds a different corpus; pass --overwrite to replace it")
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.replace(out, old)
    os.replace(tmp, out)
    _fsync_dir(out.parent)
    shutil.rmtree(old)
    return False


def _same_tree(a: Path, b: Path) -> bool:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b and all(filecmp.cmp(a / f, b / f, shallow=False) for f in files_a)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
