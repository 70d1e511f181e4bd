"""Property: decoding a built corpus gives back every kept record's text, roles and targets.

Uses mistral_v1 as a SentencePiece model: it has byte fallback and no whitespace
normalisation, so any text round-trips (the Turkish models fold whitespace and cannot) except
one holding SentencePiece's space mark ``▁``, which decodes as a space (the builder counts that
loss: ``test_lossless.py``).
"""

from __future__ import annotations

import gzip
import json

import sentencepiece
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.format import discover_shards

ROLES = ("system", "user", "assistant")

text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40).filter(
    lambda t: t.strip() and "<|mesaj_" not in t and "\u2581" not in t
)
message = st.tuples(st.sampled_from(ROLES), text, st.booleans())
conversation = st.lists(message, min_size=1, max_size=6)


def _record(messages, i):
    return {
        "id": i,
        "messages": [
            {"role": role, "content": content, **({} if train else {"train": False})}
            for role, content, train in messages
        ],
    }


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(conversations=st.lists(conversation, min_size=1, max_size=8), shards=st.integers(1, 3))
def test_kept_records_round_trip(tmp_path_factory, sentencepiece_model, conversations, shards):
    tmp = tmp_path_factory.mktemp("rt")
    records = [_record(c, i) for i, c in enumerate(conversations)]
    (tmp / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    # only conversations with a trainable assistant message can be kept
    kept = [
        r
        for r in records
        if any(m["role"] == "assistant" and m.get("train", True) for m in r["messages"])
    ]
    if len(kept) < shards:
        return  # too few documents for the shards: refused, covered by the builder tests
    build_corpus(
        [tmp / "gen.jsonl"],
        sentencepiece_model,
        tmp / "out",
        BuildOptions(seq_len=4096, shards=shards),
    )

    sp = sentencepiece.SentencePieceProcessor(
        model_proto=gzip.decompress(sentencepiece_model.read_bytes())
    )
    built = discover_shards(tmp / "out")
    for i, record in enumerate(kept):
        shard = built[i % shards]
        doc = shard.index[i // shards]
        tokens = shard.tokens[int(doc["token_start"]) : int(doc["token_start"] + doc["token_len"])]
        segments = shard.segments[
            int(doc["segment_start"]) : int(doc["segment_start"] + doc["segment_count"])
        ]
        assert len(segments) == len(record["messages"])
        for seg, m in zip(segments, record["messages"], strict=True):
            content = tokens[seg["start"] + seg["header_len"] : seg["start"] + seg["length"] - 1]
            assert sp.decode(content.tolist()) == m["content"]
            assert ROLES[seg["role"]] == m["role"]
            assert bool(seg["trainable"]) == (m["role"] == "assistant" and m.get("train", True))
        assert tokens[-1] == 2
