"""``advice``: every drop reason has a hint a user can act on; warnings start at their share."""

from __future__ import annotations

import re

import pytest

from nedolm.data import packing, sources
from nedolm.data.advice import DUPLICATE_WARNING, LOST_WARNING, build_warnings, drop_hint
from nedolm.data.builder import BuildReport, SourceReport

REASONS = sorted(
    value
    for module in (sources, packing)
    for name, value in vars(module).items()
    if name.isupper() and isinstance(value, str) and re.fullmatch(r"[a-z][a-z0-9_]+", value)
)


def test_the_reasons_are_all_found():
    assert {"invalid_json", "unsupported_role", "hard_continuation", "no_target"} <= set(REASONS)
    assert len(REASONS) == 17


@pytest.mark.parametrize("reason", REASONS)
def test_every_drop_reason_has_its_own_hint(reason):
    hint = drop_hint(reason, 512, 700)
    assert hint != drop_hint("a reason nobody knows", 512), hint


def test_length_hints_name_seq_len_and_the_longest():
    assert drop_hint("hard_continuation", 512, 700) == (
        "an assistant message longer than --seq-len 512 tokens (longest: 700);"
        " raise --seq-len or split it"
    )
    assert "--seq-len 512 tokens (longest: 900); raise --seq-len" in drop_hint(
        "message_too_long", 512, 900
    )
    assert drop_hint("message_too_long", 512) == (  # stats: the manifest has no longest
        "a context message (system, user or tool) longer than --seq-len 512 tokens;"
        " raise --seq-len or shorten it"
    )


def report(kept: int, lost: int, characters: int, dups: int, deduped: int = 0) -> BuildReport:
    source = SourceReport(
        name="a.jsonl",
        sha256="0" * 64,
        records=kept + deduped,
        kept=kept,
        dropped={"duplicate_conversation": deduped} if deduped else {},
        unk_target_tokens=0,
        lost_characters=lost,
        duplicate_conversations=dups,
    )
    return BuildReport(
        out="o",
        sources=[source],
        shards=1,
        validation_shard_ids=[],
        documents=kept,
        tokens=1,
        identical_rebuild=False,
        content_characters=characters,
    )


def test_warnings_start_above_their_share():
    characters, kept = 100_000, 1000
    at_lost, at_dups = int(LOST_WARNING * characters), int(DUPLICATE_WARNING * kept)
    assert build_warnings(report(kept, at_lost, characters, at_dups)) == []
    lost, dups = build_warnings(report(kept, at_lost + 1, characters, at_dups + 1))
    assert lost.startswith(f"warning: the tokenizer loses {at_lost + 1} characters (0.10% of")
    assert dups.startswith(f"warning: {at_dups + 1} kept conversations (1.1%")
    assert dups.endswith("--dedup drops them")
    # under --dedup the duplicates are dropped (and their drop line says so): no warning
    assert build_warnings(report(kept, 0, characters, 50, deduped=50)) == []
