"""What a build is asked to do (``BuildOptions``) and how it refuses (``BuildError``).

Shared by every build stage: the encoder, the shard sink, the installer and ``build_corpus``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nedolm.data.inputs import FORMATS
from nedolm.data.sources import MAX_LINE_BYTES, RecordPolicy

DEFAULT_SHARDS = 20
"""Shards when neither ``shards`` nor ``shard_tokens`` is given, so that the one held out by
default is 5% of the corpus; a corpus of fewer documents gets one shard per document."""
DEFAULT_VAL_FRACTION = 0.05
"""Held out for validation when neither ``val_shards`` nor ``val_fraction`` is given (a common
held-out share), at least one shard; a corpus of one shard holds nothing out."""


class BuildError(RuntimeError):
    """The build cannot produce a corpus (bad options, nothing kept, an occupied ``out``)."""


@dataclass(frozen=True)
class BuildOptions:
    """How to turn inputs into shards; the same options give byte-identical output."""

    seq_len: int  # the packing audit is computed for this context length
    shards: int | None = None  # N shards, documents dealt round-robin (default DEFAULT_SHARDS)
    shard_tokens: int | None = None  # or: fill shards in order up to this many tokens each
    val_shards: tuple[int, ...] = ()  # shard ids held out for validation
    val_fraction: float | None = None  # or: the last ceil(fraction * N) shards; 0: none
    # (neither: DEFAULT_VAL_FRACTION, and no validation for a corpus of one shard)
    policy: RecordPolicy = field(default_factory=RecordPolicy)
    input_format: str = "auto"  # inputs.FORMATS: detected per input, or forced
    messages_field: str | None = None  # the key/column holding the turns (default: messages)
    workers: int = 1  # 1: encode in this process; >1: a pool of processes
    chunk_records: int = 256
    max_line_bytes: int = MAX_LINE_BYTES  # a longer input line is a bad record, never read whole
    overwrite: bool = False  # replace an ``out`` that holds a different corpus
    dedup: bool = False  # drop a conversation laid out exactly like an earlier one (always counted)
    weights: tuple[float, ...] = ()  # a mixture: one weight per input (see ``mixture``)
    mix_total: int | None = None  # a mixture's conversations (default: the inputs' usable ones)
    seed: int = 0  # draws a mixture's conversations
    max_drop_fraction: float | None = None  # refuse a build that loses more (see ``drops``)

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
        if self.val_fraction is not None and not 0 <= self.val_fraction < 1:
            raise BuildError(f"--val-fraction must be in [0, 1), not {self.val_fraction}")
        if self.input_format not in FORMATS:
            raise BuildError(
                f"--format must be one of {', '.join(FORMATS)}, not {self.input_format!r}"
            )
        if self.workers < 1 or self.chunk_records < 1:
            raise BuildError("--workers and the chunk size must be at least 1")
        if self.max_line_bytes < 1:
            raise BuildError(f"--max-line-bytes must be positive, not {self.max_line_bytes}")
        if any(not 0 < w < math.inf for w in self.weights):
            raise BuildError(f"mixture weights must be positive numbers, not {self.weights}")
        if self.mix_total is not None and (self.mix_total < 1 or not self.weights):
            raise BuildError("--mix-total needs --mix and must be at least 1")
        if self.max_drop_fraction is not None and not 0 <= self.max_drop_fraction <= 1:
            raise BuildError(f"--max-drop-fraction must be in [0, 1], not {self.max_drop_fraction}")

    @property
    def round_robin_shards(self) -> int | None:
        """Shards dealt round-robin: ``shards`` or DEFAULT_SHARDS; None under ``shard_tokens``."""
        return None if self.shard_tokens is not None else (self.shards or DEFAULT_SHARDS)

    @property
    def default_split(self) -> bool:
        """Neither ``val_shards`` nor ``val_fraction`` was given: DEFAULT_VAL_FRACTION applies."""
        return not self.val_shards and self.val_fraction is None

    def validation_ids(self, num_shards: int) -> list[int]:
        """The held-out shard ids of a corpus of ``num_shards`` shards."""
        ids = sorted(set(self.val_shards))
        if not self.val_shards:
            fraction = DEFAULT_VAL_FRACTION if self.val_fraction is None else self.val_fraction
            # At least one shard unless fraction is 0; rounded first: 0.07 * 100 is 7.000000000000001
            count = math.ceil(round(fraction * num_shards, 9))
            if self.default_split and count >= num_shards:
                return []  # one shard: nothing can be held out
            ids = list(range(num_shards - count, num_shards))
        if any(not 0 <= i < num_shards for i in ids):
            raise BuildError(f"validation shard ids {ids} outside 0..{num_shards - 1}")
        if ids and len(ids) >= num_shards:
            raise BuildError(f"validation takes all {num_shards} shards; none left to train on")
        return ids
