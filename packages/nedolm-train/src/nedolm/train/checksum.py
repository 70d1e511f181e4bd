"""SHA-256 digests of checkpoints, so that flipped bytes anywhere in one are caught, not only
truncation, wherever the file is copied.

A checkpoint file written here carries its digest twice, both computed while it is written (no
second pass):

- *inside it*, as the comment of the zip archive that ``torch.save`` writes (``nedolm-sha256:``
  + the hex digest of the file as torch wrote it, i.e. with an empty comment). ``cp *.pt``
  takes it along, and ``torch.load`` and zip tools ignore it;
- in a sidecar ``step-00000100.pt.sha256`` beside it: the digest of the whole file, installed
  before the file's own rename, for ``sha256sum -c`` and for readers older than the comment.

A file is checked against its sidecar when it has one, else against its own comment. One
without either (written before digests existed, or by another program: a pretraining run's
base checkpoint) carries no digest: ``has_digest`` tells, and the resume refuses to trust it
unless asked to (``nedolm.train.checkpoint``).

A sharded checkpoint directory lists the digest of each of its files in its manifest, which is
written last (``nedolm.train.sharded``): ``file_digests`` and ``digest_mismatch``.

A reader that needs only the weights (generate, chat, export, a base for SFT) should not read
and hash a whole training checkpoint, two thirds of which is AdamW state: ``tensors_sha256``
digests the model tensors alone, stored inside the checkpoint beside them (written since the
model digest existed; older files are checked whole).
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import IO

import torch

SUFFIX = ".sha256"
_CHUNK = 16 * 2**20
_EOCD = struct.Struct("<4s16sH")  # zip end-of-central-directory record: magic, body, comment
_EOCD_MAGIC = b"PK\x05\x06"
_MARK = b"nedolm-sha256:"
_COMMENT_BYTES = len(_MARK) + 64


def checksum_path(path: Path) -> Path:
    """The sidecar of ``path``."""
    return path.with_name(path.name + SUFFIX)


class DigestWriter:
    """A write-only file wrapper for ``torch.save`` that signs the zip it writes.

    Bytes go through to ``handle`` as they come, except the last record (the zip's end
    record), held back until ``finish`` writes it with the digest as its comment. Keeps the
    ``OSError`` of a failed write in ``error``: ``torch.save`` reports it as a bare
    RuntimeError ("unexpected pos"), losing the errno that tells a full disk apart.
    """

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.error: OSError | None = None
        self._hash = hashlib.sha256()  # of every byte passed on
        self._tail = b""

    def write(self, data: bytes) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= _EOCD.size:
            self._emit(self._tail)
            self._emit(view[: -_EOCD.size])
            self._tail = bytes(view[-_EOCD.size :])
        else:
            joined = self._tail + bytes(view)
            self._emit(joined[: -_EOCD.size])
            self._tail = joined[-_EOCD.size :]
        return len(view)

    def flush(self) -> None:
        self.handle.flush()

    def finish(self) -> str:
        """Write the end record with the digest comment; returns the whole file's hex digest.

        Raises:
            ValueError: what was written does not end like a zip without a comment.
        """
        magic, body, comment_bytes = _EOCD.unpack(self._tail.rjust(_EOCD.size, b"\0"))
        if magic != _EOCD_MAGIC or comment_bytes != 0:
            raise ValueError("torch.save did not end its file with a bare zip end record")
        content = self._hash.copy()
        content.update(self._tail)
        comment = _MARK + content.hexdigest().encode("ascii")
        self._emit(_EOCD.pack(magic, body, len(comment)) + comment)
        return self._hash.hexdigest()

    def _emit(self, data: bytes | memoryview) -> None:
        if not data:
            return
        self._hash.update(data)
        try:
            self.handle.write(data)
        except OSError as exc:
            self.error = exc
            raise


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of the file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _embedded(path: Path) -> tuple[str, int] | None:
    """The digest in ``path``'s zip comment and the size of the bytes it covers, if any."""
    size = os.path.getsize(path)
    record = _EOCD.size + _COMMENT_BYTES
    if size < record:
        return None
    with path.open("rb") as handle:
        handle.seek(size - record)
        tail = handle.read(record)
    magic, _, comment_bytes = _EOCD.unpack(tail[: _EOCD.size])
    comment = tail[_EOCD.size :]
    if magic != _EOCD_MAGIC or comment_bytes != _COMMENT_BYTES or not comment.startswith(_MARK):
        return None
    return comment[len(_MARK) :].decode("ascii", errors="replace"), size - _COMMENT_BYTES - 2


def _content_sha256(path: Path, covered: int) -> str:
    """The digest of the file as torch wrote it: up to the comment length, which was 0."""
    digest = hashlib.sha256()
    left = covered
    with path.open("rb") as handle:
        while left > 0 and (chunk := handle.read(min(_CHUNK, left))):
            digest.update(chunk)
            left -= len(chunk)
    digest.update(b"\0\0")
    return digest.hexdigest()


def has_digest(path: Path) -> bool:
    """True when ``path`` can be verified: it has a sidecar or a digest inside it."""
    return checksum_path(path).exists() or _embedded(path) is not None


def checksum_mismatch(path: Path) -> str | None:
    """Why ``path`` fails its digest (a one-line reason), or None when it matches or has none."""
    sidecar = checksum_path(path)
    if sidecar.exists():
        expected = sidecar.read_text(encoding="ascii", errors="replace").strip()
        actual = file_sha256(path)
        where = sidecar.name
    elif (embedded := _embedded(path)) is not None:
        expected, covered = embedded
        actual = _content_sha256(path, covered)
        where = "the digest inside it"
    else:
        return None
    if actual != expected:
        return f"sha256 {actual[:16]}... does not match {where} ({expected[:16]}...)"
    return None


def file_digests(directory: Path) -> dict[str, str]:
    """Hex SHA-256 of every file directly in ``directory``, by name."""
    return {path.name: file_sha256(path) for path in sorted(Path(directory).iterdir())}


def digest_mismatch(directory: Path, expected: dict[str, str]) -> str | None:
    """Why the files of ``directory`` differ from ``expected`` (one line), or None if they match."""
    for name, digest in sorted(expected.items()):
        path = Path(directory) / name
        if not path.is_file():
            return f"{name} is missing"
        actual = file_sha256(path)
        if actual != digest:
            return f"{name}: sha256 {actual[:16]}... does not match the manifest ({digest[:16]}...)"
    return None


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """Hex SHA-256 of a state dict: each tensor's name, dtype, shape and bytes, by name.

    Reads only these tensors' bytes (of a memory-mapped file: only their pages).
    """
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        if not isinstance(tensor, torch.Tensor):
            continue
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()
