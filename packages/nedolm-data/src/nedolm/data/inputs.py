"""Input files of any supported format → a stream of records in the form ``parse_record`` reads.

One input path is one of:

* ``jsonl``: JSON lines, plain, gzip (``.gz``) or zstandard (``.zst``; the ``zstd`` extra),
  recognised by their magic bytes. OpenAI and Alpaca lines pass through byte for byte; a line
  whose object holds ``conversations`` (and no ``messages``) is ShareGPT and is converted.
  A file whose first byte (past a BOM and whitespace) is ``[`` is one JSON array of such
  records instead (LLaMA-Factory's ``data/*.json``), read one element at a time
  (``json_array``).
* ``sharegpt``: the same files, every record converted from ShareGPT (forced).
* ``parquet``: a Parquet file (the ``parquet`` extra), read one batch of one row group at a time.
* ``datasets``: a directory written by ``datasets``' ``save_to_disk`` (``state.json`` +
  Arrow stream files; the ``datasets`` extra), read one record batch at a time with pyarrow.

``read_records`` yields ``(record number, record)``: the number is the 1-based line number for
JSON lines (blank lines are counted, not yielded), the 0-based index for a JSON array and the
1-based row number over the whole file or directory for Parquet and Arrow, so
``SourceLabel.where(number)`` (``train.jsonl:17``, ``train.json: record 17``) points at it. The
record is canonical JSON bytes, or a ``Rejected`` when a ShareGPT record cannot be converted
(the builder's policy then stops or drops it like any bad record). A file that cannot be read
at all raises ``InputError`` naming it. Memory is one line, one array element or one record
batch, never the file.

Arrow rows (Parquet, ``datasets``) lose their null fields: a struct column cannot tell a key
that was absent from one that was null, and ``parse_record`` treats the two alike.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from nedolm.data.hashing import file_sha256
from nedolm.data.json_array import Oversized, array_items, starts_array
from nedolm.data.sharegpt import ShareGPTError, is_sharegpt_turns, to_openai
from nedolm.data.sources import (
    LINE_TOO_LONG,
    MAX_LINE_BYTES,
    MISSING_MESSAGES,
    InputError,
    Rejected,
    SourceLabel,
)

FORMATS = ("auto", "jsonl", "sharegpt", "parquet", "datasets")
DEFAULT_MESSAGE_FIELDS = ("messages", "conversations")

ProgressHook = Callable[[int], None]
"""Called with the bytes of the input consumed so far (compressed bytes for .gz/.zst)."""

_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_PARQUET_MAGIC = b"PAR1"
_NORMALISED_SUFFIXES = (".jsonl.gz", ".jsonl.zst", ".parquet")
_PROGRESS_EVERY = 1024  # records between two progress calls for JSON lines
_BATCH_ROWS = 1024  # Arrow rows converted at once
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def detect_format(path: Path | str) -> str:
    """``datasets`` for a ``save_to_disk`` directory, ``parquet`` by magic bytes, else ``jsonl``."""
    path = Path(path)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
            raise InputError(
                f"{path}: a DatasetDict with splits {', '.join(splits)};"
                f" pass one split's directory (e.g. {path / splits[0] if splits else path})"
            )
        if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
            return "datasets"
        raise InputError(f"{path}: a directory, but not one written by datasets' save_to_disk")
    if not path.is_file():
        raise InputError(f"{path}: input file not found")
    with path.open("rb") as f:
        return "parquet" if f.read(4) == _PARQUET_MAGIC else "jsonl"


def input_size(path: Path | str) -> int:
    """The byte count the progress hook reaches at the end of ``path`` (the progress bar total)."""
    path = Path(path)
    if path.is_dir():
        return sum(f.stat().st_size for f in _arrow_files(path))
    return path.stat().st_size


def source_names(paths: Sequence[Path | str]) -> list[str]:
    """The name of each input in record keys, messages and the build report.

    Its path relative to the inputs' common directory, so ``a/train.jsonl`` and
    ``b/train.jsonl`` differ, with the data-format suffix written as ``.jsonl``
    (``train.parquet``, ``train.jsonl.gz``, a ``datasets`` directory ``train`` → ``train.jsonl``),
    so the same conversations in any format get the same keys and shards. Inputs whose names
    would then coincide keep their suffixes.
    """
    resolved = [Path(p).resolve() for p in paths]
    common = Path(os.path.commonpath([p.parent for p in resolved]))
    relative = [p.relative_to(common).as_posix() for p in resolved]
    normalised = [_as_jsonl(name, p.is_dir()) for name, p in zip(relative, resolved, strict=True)]
    taken = Counter(normalised)
    return [n if taken[n] == 1 else r for n, r in zip(normalised, relative, strict=True)]


def source_labels(paths: Sequence[Path | str], input_format: str = "auto") -> list[SourceLabel]:
    """``source_names`` with the way messages number each input's records (``SourceLabel``)."""
    return [
        SourceLabel(name, indexed=_is_json_array(Path(path), input_format))
        for name, path in zip(source_names(paths), paths, strict=True)
    ]


def _is_json_array(path: Path, input_format: str) -> bool:
    if input_format not in ("auto", "jsonl", "sharegpt") or detect_format(path) != "jsonl":
        return False
    with path.open("rb") as raw:
        return starts_array(_decompressed(raw, path))


def _as_jsonl(name: str, is_dir: bool) -> str:
    if is_dir:
        return f"{name}.jsonl"
    for suffix in _NORMALISED_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ".jsonl"
    return name


def input_sha256(path: Path | str) -> str:
    """sha256 of a file; of a ``datasets`` directory, sha256 over its Arrow files' digests."""
    path = Path(path)
    if not path.is_dir():
        return file_sha256(path)
    digests = "".join(file_sha256(file) for file in _arrow_files(path))
    return hashlib.sha256(digests.encode()).hexdigest()


def read_records(
    path: Path | str,
    input_format: str = "auto",
    messages_field: str | None = None,
    on_progress: ProgressHook | None = None,
    name: str | None = None,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> Iterator[tuple[int, bytes | Rejected]]:
    """(record number, canonical JSON bytes or a rejection) of every record of one input.

    ``messages_field`` names the key (JSON lines) or column (Arrow) holding the turns, OpenAI
    or ShareGPT; by default ``messages``, then ``conversations`` (Alpaca records have neither).
    ``name`` names the input in rejections (default: the file name; see ``source_names``).
    A JSON line longer than ``max_line_bytes`` is rejected without being read whole.
    """
    if input_format not in FORMATS:
        raise ValueError(f"input format must be one of {', '.join(FORMATS)}, not {input_format!r}")
    path = Path(path)
    detected = detect_format(path)
    if input_format == "auto":
        input_format = detected
    elif input_format in ("jsonl", "sharegpt") and detected != "jsonl":
        raise InputError(f"{path}: is {detected}, not JSON lines ({input_format})")
    elif input_format in ("parquet", "datasets") and detected != input_format:
        raise InputError(f"{path}: is not a {input_format} input (looks like {detected})")
    hook = on_progress or (lambda _: None)
    name = name or path.name
    if input_format == "parquet":
        return _parquet_records(path, name, messages_field, hook)
    if input_format == "datasets":
        return _datasets_records(path, name, messages_field, hook)
    sharegpt = input_format == "sharegpt"
    return _jsonl_records(path, name, sharegpt, messages_field, hook, max_line_bytes)


# --- JSON lines --------------------------------------------------------------------------------


def _jsonl_records(
    path: Path,
    name: str,
    sharegpt: bool,
    field: str | None,
    hook: ProgressHook,
    max_line_bytes: int,
) -> Iterator[tuple[int, bytes | Rejected]]:
    """JSON lines, or the elements of one JSON array (numbered by index, see ``SourceLabel``)."""
    with path.open("rb") as raw:
        stream = _decompressed(raw, path)
        label, upcoming = SourceLabel(name), 1  # the number of the record being read
        try:
            if starts_array(stream):
                label, upcoming = SourceLabel(name, indexed=True), 0
                items = array_items(stream, name, max_line_bytes)
            else:
                items = _json_lines(stream, max_line_bytes)
            for number, item in items:
                if number % _PROGRESS_EVERY == 0:
                    hook(raw.tell())
                where, upcoming = label.where(number), number + 1
                if rejected := oversized_rejection(item, where, max_line_bytes):
                    yield number, rejected
                else:
                    yield number, _jsonl_record(item, where, sharegpt, field)
        except (EOFError, OSError, zlib.error) as exc:
            raise InputError(
                f"{label.where(upcoming)}: the compressed stream is cut or damaged ({exc})"
            ) from None
        hook(raw.tell())


def _json_lines(f: BinaryIO, max_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line) of every line that is not blank, a BOM stripped."""
    for line_no, line in enumerate(bounded_lines(f, max_bytes), start=1):
        if line_no == 1 and not isinstance(line, OversizedLine):
            line = line.removeprefix(b"\xef\xbb\xbf")
        if isinstance(line, OversizedLine) or line.strip():
            yield line_no, line


class OversizedLine(bytes):
    """Stands for an input line longer than the limit, which is skipped, never held whole:
    ``size`` is its length in bytes, ``limit`` the limit it broke."""

    size: int
    limit: int


def bounded_lines(f: BinaryIO, max_bytes: int) -> Iterator[bytes]:
    """The lines of ``f``, reading at most ``max_bytes + 1`` bytes of any line into memory;
    a longer line comes as an ``OversizedLine`` after the rest of it was skipped."""
    while raw := f.readline(max_bytes + 1):
        if len(raw) <= max_bytes or raw.endswith(b"\n"):
            yield raw
            continue
        size = len(raw)
        while not raw.endswith(b"\n") and (raw := f.readline(1 << 20)):
            size += len(raw)
        line = OversizedLine(b"<oversized line>")
        line.size, line.limit = size, max_bytes
        yield line


def oversized_rejection(raw: bytes, where: str, limit: int) -> Rejected | None:
    """The rejection of a line or array element skipped for being over ``limit`` bytes."""
    if not isinstance(raw, (OversizedLine, Oversized)):
        return None
    what = "line" if isinstance(raw, OversizedLine) else "record"
    return Rejected(
        LINE_TOO_LONG,
        f"{where}: the {what} holds {raw.size} bytes, more than the limit of {limit}"
        " (--max-line-bytes)",
    )


def _decompressed(raw: BinaryIO, path: Path) -> BinaryIO:
    magic = raw.read(4)
    raw.seek(0)
    if magic.startswith(_GZIP_MAGIC):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if magic == _ZSTD_MAGIC:
        try:
            import zstandard
        except ImportError:
            raise InputError(
                f"{path}: zstandard-compressed; install the extra: pip install 'nedolm-data[zstd]'"
            ) from None
        return io.BufferedReader(_ZstdStream(raw, zstandard))
    return raw


class _ZstdStream(io.RawIOBase):
    """The decompressed bytes of every zstandard frame of ``raw``, read in small chunks.

    Written over ``decompressobj`` rather than zstandard's ``stream_reader`` because the latter
    just stops at a cut file, which would silently lose the records after the cut.
    """

    _CHUNK = 1 << 16

    def __init__(self, raw: BinaryIO, zstandard: Any) -> None:
        self._raw, self._zstandard = raw, zstandard
        self._frame = zstandard.ZstdDecompressor().decompressobj()
        self._pending, self._offset = b"", 0
        self._started = False  # a frame has input that it has not finished

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._offset == len(self._pending):
            compressed = self._raw.read(self._CHUNK)
            if not compressed:
                if self._started:
                    raise EOFError("the last zstandard frame ends early")
                return 0
            self._pending, self._offset = self._decompress(compressed), 0
        n = min(len(buffer), len(self._pending) - self._offset)
        buffer[:n] = memoryview(self._pending)[self._offset : self._offset + n]
        self._offset += n
        return n

    def _decompress(self, compressed: bytes) -> bytes:
        out = []
        try:
            while compressed:
                out.append(self._frame.decompress(compressed))
                self._started = not self._frame.eof
                compressed = self._frame.unused_data if self._frame.eof else b""
                if self._frame.eof:
                    self._frame = self._zstandard.ZstdDecompressor().decompressobj()
        except self._zstandard.ZstdError as exc:
            raise OSError(f"zstandard: {exc}") from None
        return b"".join(out)


def _jsonl_record(line: bytes, where: str, sharegpt: bool, field: str | None) -> bytes | Rejected:
    # The substring test keeps OpenAI/Alpaca lines undecoded here: parse_record decodes them once.
    if not sharegpt and field is None and b'"conversations"' not in line:
        return line
    try:
        record = _decode(line)
    except msgspec.DecodeError:
        return line  # parse_record names the malformed JSON or UTF-8 the same way as for any line
    if not isinstance(record, dict) or (field is None and not sharegpt and "messages" in record):
        return line
    return _canonical(record, where, field, sharegpt)


# --- Arrow: Parquet and datasets ---------------------------------------------------------------


def _parquet_records(
    path: Path, name: str, field: str | None, hook: ProgressHook
) -> Iterator[tuple[int, bytes | Rejected]]:
    pq = _pyarrow_module("pyarrow.parquet", "parquet", path)
    try:
        parquet = pq.ParquetFile(path, pre_buffer=False)  # pre-buffering reads ahead, slower
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError subclasses
        raise InputError(f"{path}: not a readable Parquet file ({exc})") from None
    field = _message_column(path, parquet.schema_arrow.names, field)
    size, rows = path.stat().st_size, max(parquet.metadata.num_rows, 1)
    row = 0
    with parquet:
        # One row group at a time: iter_batches over the whole file pre-buffers every row group.
        for group in range(parquet.num_row_groups):
            for batch in parquet.iter_batches(batch_size=_BATCH_ROWS, row_groups=[group]):
                yield from _batch_records(batch, name, row, field)
                row += batch.num_rows
                hook(size * row // rows)  # pages are compressed per column: rows are the gauge
    hook(size)


def _datasets_records(
    path: Path, name: str, field: str | None, hook: ProgressHook
) -> Iterator[tuple[int, bytes | Rejected]]:
    pa = _pyarrow_module("pyarrow", "datasets", path)
    files = _arrow_files(path)
    done, row = 0, 0
    for file in files:
        with pa.memory_map(str(file)) as source:
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid as exc:
                raise InputError(f"{file}: not an Arrow stream file ({exc})") from None
            column = _message_column(path, reader.schema.names, field)
            for batch in reader:
                yield from _batch_records(batch, name, row, column)
                row += batch.num_rows
                hook(done + source.tell())
        done += file.stat().st_size
    hook(done)


def _arrow_files(path: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` directory, in row order (``state.json``)."""
    try:
        state = json.loads((path / "state.json").read_text())
        files = [path / entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{path / 'state.json'}: not a datasets state file ({exc!r})") from None
    for file in files:
        if not file.is_file():
            raise InputError(f"{file}: listed in state.json but missing")
    return files


def _pyarrow_module(module: str, extra: str, path: Path) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise InputError(
            f"{path}: reading it needs pyarrow; install the extra: pip install 'nedolm-data[{extra}]'"
        ) from None


def _message_column(path: Path, columns: list[str], field: str | None) -> str | None:
    """The column holding the turns; None for Alpaca rows (instruction + output)."""
    if field is not None:
        if field in columns:
            return field
        raise InputError(f"{path}: no column {field!r} (columns: {', '.join(columns)})")
    for name in DEFAULT_MESSAGE_FIELDS:
        if name in columns:
            return name
    if "instruction" in columns and "output" in columns:
        return None
    raise InputError(
        f"{path}: no 'messages' or 'conversations' column and no Alpaca 'instruction'/'output'"
        f" (columns: {', '.join(columns)}); name the column with messages_field"
    )


def _batch_records(
    batch: Any, name: str, first_row: int, field: str | None
) -> Iterator[tuple[int, bytes | Rejected]]:
    names = batch.schema.names
    columns = []
    for column in batch.columns:
        values = column.to_pylist()
        columns.append([_without_nulls(v) for v in values] if _nested_nulls(column) else values)
    for row, values in enumerate(zip(*columns, strict=True), start=first_row + 1):
        record = {k: v for k, v in zip(names, values, strict=True) if v is not None}
        yield row, _canonical(record, f"{name}:{row}", field)


def _nested_nulls(array: Any) -> bool:
    """Whether an Arrow array has nulls below its top level (most columns have none, and
    walking every value of those in Python would cost as much as the rest of the reading)."""
    kind = array.type
    if kind.num_fields == 0:
        return False
    if hasattr(array, "flatten") and not hasattr(array, "field"):  # list, large list
        child = array.flatten()
        return child.null_count > 0 or _nested_nulls(child)
    if hasattr(array, "field"):  # struct
        return any(
            array.field(i).null_count > 0 or _nested_nulls(array.field(i))
            for i in range(kind.num_fields)
        )
    return True  # maps, unions, ...: walk them


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


# --- one record --------------------------------------------------------------------------------


def _canonical(
    record: dict[str, Any], where: str, field: str | None, sharegpt: bool = False
) -> bytes | Rejected:
    """The OpenAI-form JSON of a decoded record: its turns under ``messages``, other keys kept.

    ShareGPT turns are recognised by their ``from`` keys (or the ``conversations`` key);
    ``sharegpt`` insists on them. A record without turns is encoded as it is (Alpaca, or bad
    input that ``parse_record`` names).
    """
    field = field or next((f for f in DEFAULT_MESSAGE_FIELDS if f in record), None)
    try:
        if field is None or field not in record:
            if sharegpt:
                raise ShareGPTError(MISSING_MESSAGES, "no ShareGPT 'conversations' list")
            return _encode(record)
        if sharegpt or field == "conversations" or is_sharegpt_turns(record[field]):
            record = to_openai(record, field)
        elif field != "messages":
            record = {"messages": record[field], **{k: v for k, v in record.items() if k != field}}
    except ShareGPTError as exc:
        return Rejected(exc.reason, f"{where}: {exc}")
    return _encode(record)
