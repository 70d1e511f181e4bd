"""The binary shard format: headered flat arrays, the shard triple, and SPECIAL_TOKENS.json.

Every ``*.bin`` file is a 64-byte header followed by a flat little-endian array, so a reader
maps it with ``np.memmap`` without copying and can refuse a wrong, truncated or foreign file
with a message that names it (the header layout is documented in ``FORMAT.md``). Writers go
through a temporary file and ``os.replace``: a crash never leaves a file that looks complete.
"""

from __future__ import annotations

import functools
import os
import re
import struct
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
import numpy as np

from nedolm.data.records import INDEX_DTYPE, SEGMENT_DTYPE

FORMAT_VERSION = 1
HEADER_BYTES = 64  # data starts 64-byte aligned
_HEADER = struct.Struct("<8sHHIQ")  # magic, version, dtype code, record size, record count

KINDS = ("tokens", "segments", "index")
_MAGIC = {"tokens": b"NEDOTOKN", "segments": b"NEDOSEGM", "index": b"NEDOINDX"}
_DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype("<u2"),
    2: np.dtype("<u4"),
    16: SEGMENT_DTYPE,
    17: INDEX_DTYPE,
}
_KIND_CODES = {"tokens": (1, 2), "segments": (16,), "index": (17,)}

SHARDS_DIR = "shards"
SPECIAL_TOKENS_FILE = "SPECIAL_TOKENS.json"
_SHARD_NAME = re.compile(r"^sft-(\d{5,})-of-(\d{5,})\.(tokens|segments|index)\.bin$")


class ShardFormatError(ValueError):
    """A shard file or directory that is not a valid corpus; the message names the file."""


def _dtype_code(kind: str, dtype: np.dtype) -> int:
    for code in _KIND_CODES[kind]:
        if _DTYPE_CODES[code] == dtype:
            return code
    allowed = [str(_DTYPE_CODES[c]) for c in _KIND_CODES[kind]]
    raise ValueError(f"a {kind} file holds one of {allowed}, not {dtype}")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown shard file kind {kind!r}; expected one of {KINDS}")


def _header(kind: str, code: int, count: int) -> bytes:
    packed = _HEADER.pack(_MAGIC[kind], FORMAT_VERSION, code, _DTYPE_CODES[code].itemsize, count)
    return packed.ljust(HEADER_BYTES, b"\0")


class ArrayWriter:
    """Append arrays to one binary file; the file appears under its name only on success.

    Streaming writers keep memory bounded: a shard's tokens are written as documents arrive.
    The header's record count is filled in by ``close``; an exception inside the ``with``
    block deletes the temporary file instead.
    """

    def __init__(self, path: Path, kind: str, dtype: np.dtype) -> None:
        _check_kind(kind)
        self.path = Path(path)
        self.kind = kind
        self.dtype = np.dtype(dtype)
        self._code = _dtype_code(kind, self.dtype)
        self.count = 0
        self._tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        self._file: BinaryIO | None = self._tmp.open("wb")
        self._file.write(_header(kind, self._code, 0))

    def write(self, array: np.ndarray) -> None:
        if array.dtype != self.dtype:
            raise ValueError(f"{self.path}: writing {array.dtype} into a {self.dtype} file")
        assert self._file is not None, "write after close"
        self._file.write(np.ascontiguousarray(array).tobytes())
        self.count += len(array)

    def close(self) -> None:
        """Fill in the header, flush to disk and move the file to its final name."""
        assert self._file is not None, "close twice"
        self._file.seek(0)
        self._file.write(_header(self.kind, self._code, self.count))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Drop the temporary file (a no-op once the file is closed under its name)."""
        if self._file is not None:
            self._file.close()
            self._file = None
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> ArrayWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_array(path: Path, kind: str, array: np.ndarray) -> None:
    """Write ``array`` as one ``kind`` file atomically (temp file + rename)."""
    with ArrayWriter(path, kind, array.dtype) as writer:
        writer.write(array)


def read_header(path: Path, kind: str) -> tuple[np.dtype, int]:
    """Validate a file's header against its kind and size; return (dtype, record count)."""
    _check_kind(kind)
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(HEADER_BYTES)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise ShardFormatError(f"{path}: cannot read: {exc.strerror}") from exc
    if len(raw) < HEADER_BYTES:
        raise ShardFormatError(
            f"{path}: {len(raw)} bytes, shorter than the {HEADER_BYTES}-byte header"
        )
    magic, version, code, record_size, count = _HEADER.unpack_from(raw)
    if magic != _MAGIC[kind]:
        raise ShardFormatError(f"{path}: magic {magic!r} is not a {kind} file ({_MAGIC[kind]!r})")
    if version != FORMAT_VERSION:
        raise ShardFormatError(
            f"{path}: format version {version}, this reader knows {FORMAT_VERSION}"
        )
    if code not in _KIND_CODES[kind]:
        raise ShardFormatError(f"{path}: dtype code {code} is not valid for a {kind} file")
    dtype = _DTYPE_CODES[code]
    if record_size != dtype.itemsize:
        raise ShardFormatError(f"{path}: record size {record_size} != {dtype.itemsize} for {dtype}")
    expected = HEADER_BYTES + count * record_size
    if size != expected:
        raise ShardFormatError(
            f"{path}: {size} bytes but the header promises {count} records ({expected} bytes);"
            " the file is truncated or has trailing data"
        )
    return dtype, count


def read_array(path: Path, kind: str) -> np.ndarray:
    """Read-only zero-copy view of a ``kind`` file after validating its header and size."""
    dtype, count = read_header(path, kind)
    if count == 0:  # np.memmap refuses a zero-length map
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


def shard_file_name(shard_id: int, num_shards: int, kind: str) -> str:
    """``sft-00053-of-00064.tokens.bin``."""
    _check_kind(kind)
    return f"sft-{shard_id:05d}-of-{num_shards:05d}.{kind}.bin"


@dataclass(frozen=True)
class Shard:
    """One shard: three files that describe the same documents.

    The arrays are opened lazily and dropped on pickling, so a ``Shard`` is cheap to send to
    DataLoader workers; each process maps the files itself.
    """

    shard_id: int
    num_shards: int
    token_path: Path
    segments_path: Path
    index_path: Path

    @classmethod
    def in_dir(cls, shards_dir: Path, shard_id: int, num_shards: int) -> Shard:
        paths = (Path(shards_dir) / shard_file_name(shard_id, num_shards, k) for k in KINDS)
        return cls(shard_id, num_shards, *paths)

    @property
    def paths(self) -> tuple[Path, Path, Path]:
        return self.token_path, self.segments_path, self.index_path

    @functools.cached_property
    def tokens(self) -> np.ndarray:
        return read_array(self.token_path, "tokens")

    @functools.cached_property
    def segments(self) -> np.ndarray:
        return read_array(self.segments_path, "segments")

    @functools.cached_property
    def index(self) -> np.ndarray:
        return read_array(self.index_path, "index")

    def __getstate__(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)


def discover_shards(data_dir: Path) -> list[Shard]:
    """All shards under ``data_dir/shards``, sorted by id.

    Raises:
        ShardFormatError: no shards, a ``.bin`` name that does not parse, an incomplete
            triple, disagreeing ``-of-`` totals, or ids that are not exactly ``0..N-1``.
    """
    shards_dir = Path(data_dir) / SHARDS_DIR
    if not shards_dir.is_dir():
        raise ShardFormatError(f"{shards_dir}: no shards directory")
    kinds_by_id: dict[int, set[str]] = {}
    totals: set[int] = set()
    for path in sorted(shards_dir.glob("*.bin")):
        match = _SHARD_NAME.match(path.name)
        if match is None:
            raise ShardFormatError(
                f"{path}: not a shard file name (expected sft-NNNNN-of-NNNNN.<kind>.bin)"
            )
        kinds_by_id.setdefault(int(match[1]), set()).add(match[3])
        totals.add(int(match[2]))
    if not kinds_by_id:
        raise ShardFormatError(f"{shards_dir}: no shard files")
    if len(totals) != 1:
        raise ShardFormatError(f"{shards_dir}: shard names disagree on the total: {sorted(totals)}")
    (num_shards,) = totals
    for sid, kinds in sorted(kinds_by_id.items()):
        missing = [k for k in KINDS if k not in kinds]
        if missing:
            names = ", ".join(shard_file_name(sid, num_shards, k) for k in missing)
            raise ShardFormatError(f"{shards_dir}: shard {sid} is incomplete, missing {names}")
    if sorted(kinds_by_id) != list(range(num_shards)):
        absent = sorted(set(range(num_shards)) - set(kinds_by_id))
        extra = sorted(set(kinds_by_id) - set(range(num_shards)))
        raise ShardFormatError(
            f"{shards_dir}: expected shards 0..{num_shards - 1}; missing {absent}, unexpected {extra}"
        )
    return [Shard.in_dir(shards_dir, sid, num_shards) for sid in range(num_shards)]


class ControlToken(msgspec.Struct, frozen=True):
    id: int
    token: str


class TokenizerInfo(msgspec.Struct, frozen=True):
    """Which tokenizer built the corpus: enough to refuse a different one later."""

    name: str
    file: str  # the copy inside DATA_DIR, relative to it
    kind: str  # "tokenizers" (tokenizer.json) or "sentencepiece" (.model)
    sha256: str
    base_vocab_size: int


class SpecialTokens(msgspec.Struct, frozen=True):
    """SPECIAL_TOKENS.json: the ids and role registry every reader of the corpus needs."""

    schema: str
    eos_id: int
    pad_id: int
    message_start_id: int
    message_end_id: int
    vocab_size: int  # max special id + 1; every token id is below it
    control_tokens: list[ControlToken]
    roles: dict[str, str]  # role name -> Turkish header word
    role_header_token_ids: dict[str, list[int]]  # role name -> tokens of "<header word>\n"
    tokenizer: TokenizerInfo


def read_special_tokens(data_dir: Path) -> SpecialTokens:
    """Parse ``DATA_DIR/SPECIAL_TOKENS.json``; errors name the file and the bad key."""
    path = Path(data_dir) / SPECIAL_TOKENS_FILE
    try:
        return msgspec.json.decode(path.read_bytes(), type=SpecialTokens)
    except FileNotFoundError as exc:
        raise ShardFormatError(f"{path}: missing") from exc
    except msgspec.ValidationError as exc:
        raise ShardFormatError(f"{path}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ShardFormatError(f"{path}: not valid JSON: {exc}") from exc
