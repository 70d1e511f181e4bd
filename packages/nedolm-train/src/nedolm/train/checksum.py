"""SHA-256 sidecars and digests, so that flipped bytes anywhere in a checkpoint are caught, not
only truncation.

``step-00000100.pt`` gets ``step-00000100.pt.sha256`` beside it, holding the hex digest of the
file's bytes. The digest is computed while the file is written (no second pass) and the sidecar
is installed before the file's own rename, so a file under its final name that was written by
this code always has its checksum. The sidecar is a separate file, so verifying never trusts the
content being verified. Files from elsewhere (a pretraining run's base checkpoint) carry no
sidecar and are read unverified.

A sharded checkpoint directory lists the digest of each of its files in its manifest, which is
written last (``nedolm.train.sharded``): ``file_digests`` and ``digest_mismatch``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import IO

SUFFIX = ".sha256"
_CHUNK = 16 * 2**20


def checksum_path(path: Path) -> Path:
    """The sidecar of ``path``."""
    return path.with_name(path.name + SUFFIX)


class HashingWriter:
    """A write-only file wrapper that hashes every byte on its way to ``handle``.

    Keeps the ``OSError`` of a failed write in ``error``: ``torch.save`` reports it as a bare
    RuntimeError ("unexpected pos"), losing the errno that tells a full disk apart.
    """

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        try:
            return self.handle.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.handle.flush()


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of the file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checksum_mismatch(path: Path) -> str | None:
    """Why ``path`` fails its sidecar (a one-line reason), or None when it matches or has none."""
    sidecar = checksum_path(path)
    if not sidecar.exists():
        return None
    expected = sidecar.read_text(encoding="ascii", errors="replace").strip()
    actual = file_sha256(path)
    if actual != expected:
        return f"sha256 {actual[:16]}... does not match {sidecar.name} ({expected[:16]}...)"
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
