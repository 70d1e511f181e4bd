"""Shard writing: encoded documents → the three binary files of each shard, plus content digests.

Documents are dealt round-robin over N shards, or fill shards in order up to a token count.
Without either option, N is ``DEFAULT_SHARDS``, cut to the number of documents when fewer
(round-robin fills the first shards first, so that is what ``--shards <documents>`` gives).
Files are written as ``part-NNNNN.*`` (``validation-NNNNN.*``) and get their final ``sft-…-of-…`` names in ``finish``,
once the number of shards is known.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import numpy as np

from nedolm.data.build_options import BuildError, BuildOptions
from nedolm.data.encode import EncodedDocument
from nedolm.data.format import KINDS, ArrayWriter, shard_file_name
from nedolm.data.hashing import ContentDigest
from nedolm.data.records import INDEX_DTYPE, SEGMENT_DTYPE


class ShardWriter:
    """One shard's three files plus the digest of its content tokens."""

    def __init__(self, directory: Path, slot: int, dtype: np.dtype, kind: str = "part") -> None:
        base = directory / f"{kind}-{slot:05d}"
        self.tokens = ArrayWriter(base.with_suffix(".tokens.bin"), "tokens", dtype)
        self.segments = ArrayWriter(base.with_suffix(".segments.bin"), "segments", SEGMENT_DTYPE)
        self.index = ArrayWriter(base.with_suffix(".index.bin"), "index", INDEX_DTYPE)
        self.digest = ContentDigest()
        self.closed = False

    def add(self, doc: EncodedDocument) -> None:
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


class ShardSink:
    """Deals kept documents to shards: round-robin over N, or filled in order up to a size;
    each validation input's documents go to a shard of its own, after the training shards."""

    def __init__(
        self, directory: Path, options: BuildOptions, dtype: np.dtype, validation_shards: int = 0
    ) -> None:
        self.directory = directory
        self.dtype = dtype
        self.shard_tokens = options.shard_tokens
        count = options.round_robin_shards or 1  # --shard-tokens: shards open one after another
        _ensure_open_files(3 * (count + validation_shards))
        self.writers = [ShardWriter(directory, i, dtype) for i in range(count)]
        self.validation = [
            ShardWriter(directory, i, dtype, "validation") for i in range(validation_shards)
        ]
        self.documents = 0
        self.cut_to_documents = options.shards is None and options.shard_tokens is None

    def add(self, doc: EncodedDocument) -> None:
        if self.shard_tokens is None:
            writer = self.writers[self.documents % len(self.writers)]
        else:
            writer = self.writers[-1]
            if writer.tokens.count >= self.shard_tokens:
                writer.close()
                writer = ShardWriter(self.directory, len(self.writers), self.dtype)
                self.writers.append(writer)
        writer.add(doc)
        self.documents += 1

    def add_validation(self, doc: EncodedDocument, shard: int) -> None:
        """A document of the ``shard``-th validation input."""
        self.validation[shard].add(doc)

    @property
    def training_shards(self) -> int:
        """The training shards (after ``finish``: those that hold documents)."""
        return len(self.writers)

    def finish(self) -> list[str]:
        """Close every shard, give it its final name; return the content digests by shard."""
        if self.cut_to_documents and 0 < self.documents < len(self.writers):
            for empty in self.writers[self.documents :]:
                empty.abort()
            del self.writers[self.documents :]
        if self.documents < len(self.writers):
            raise BuildError(
                f"only {self.documents} documents kept, fewer than the {len(self.writers)} shards"
            )
        every = self.writers + self.validation
        for slot, writer in enumerate(every):
            writer.close()
            for kind, array_writer in zip(KINDS, writer.files, strict=True):
                os.replace(
                    array_writer.path, self.directory / shard_file_name(slot, len(every), kind)
                )
        return [w.digest.hexdigest() for w in every]

    def abort(self) -> None:
        for writer in self.writers + self.validation:
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
