"""Digests: file sha256 for the manifest and the content digest behind ``content_tokens_exact``.

Files are hashed in large chunks from a thread pool: hashlib releases the GIL on big updates,
so independent files hash in parallel.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

_CHUNK = 1 << 22


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with Path(path).open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def hash_files(root: Path, paths: list[Path], workers: int = 8) -> list[dict[str, Any]]:
    """Manifest entries ``{path, size, sha256}`` with paths relative to ``root``, in order."""

    def entry(path: Path) -> dict[str, Any]:
        return {
            "path": path.relative_to(root).as_posix(),
            "size": path.stat().st_size,
            "sha256": file_sha256(path),
        }

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(paths)))) as pool:
        return list(pool.map(entry, paths))


class ContentDigest:
    """Digest of a shard's content tokens: message content lengths, then the ids, as <u4.

    The builder feeds it per document straight from the tokenizer's output; the verifier feeds
    it the whole shard read back from the binaries. Equal digests mean equal content streams.
    """

    def __init__(self) -> None:
        self._lengths = hashlib.sha256()
        self._content = hashlib.sha256()

    def update(self, lengths: np.ndarray, content: np.ndarray) -> None:
        self._lengths.update(np.ascontiguousarray(lengths, "<u4").tobytes())
        self._content.update(np.ascontiguousarray(content, "<u4").tobytes())

    def hexdigest(self) -> str:
        return hashlib.sha256(self._lengths.digest() + self._content.digest()).hexdigest()
