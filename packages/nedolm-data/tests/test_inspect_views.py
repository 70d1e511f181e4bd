"""Window views on the real-data fixture corpus, against the loader's rows and the source text."""

import json
from itertools import chain, islice
from pathlib import Path

import numpy as np
import pytest

from nedolm.data.inspect import (
    InspectError,
    corpus_decoder,
    document_windows,
    iter_plan_rows,
    window_view,
)
from nedolm.data.loader import build_sft_loader
from nedolm.data.packing import discover_sft_shards

SEQ_LEN = 1024


@pytest.fixture(scope="module")
def shards(fixture_corpus: Path) -> list:
    return discover_sft_shards(fixture_corpus, SEQ_LEN)


def test_views_match_the_loader_rows(fixture_corpus: Path, shards: list) -> None:
    loader, dataset = build_sft_loader(fixture_corpus, SEQ_LEN, micro_batch_size=4, shards=shards)
    windows = dataset.epoch_windows(0).tolist()
    rows = chain.from_iterable(
        zip(b["tokens"], b["trainable_mask"], strict=True) for b in islice(loader, 25)
    )
    for window, (tokens, mask) in zip(windows, rows, strict=False):  # epoch 0 rows only
        view = window_view(shards, window)
        ids = [t for p in view.pieces for r in p.runs for t in r.token_ids]
        flags = [r.target for p in view.pieces for r in p.runs for _ in r.token_ids]
        assert tokens[: len(ids)].tolist() == ids
        assert mask[: len(ids)].tolist() == flags
        assert not mask[len(ids) :].any()
        assert (tokens[len(ids) :] == dataset.pad_id).all()
        assert view.targets == int(mask.sum())


def test_runs_mark_messages_and_only_assistant_content_is_a_target(shards: list) -> None:
    doc_len = {s.shard_id: s.shard.index["token_len"] for s in shards}
    for window in range(0, sum(s.plan.counts.windows for s in shards), 7):
        for piece in window_view(shards, window).pieces:
            assert piece.runs[0].message_start, "a kept corpus never starts inside a message"
            assert piece.runs[0].part == "header"
            for run in piece.runs:
                assert not run.target or (run.role == "assistant" and run.part != "header")
            ends_document = piece.end == int(doc_len[piece.shard_id][piece.doc])
            assert (piece.runs[-1].part == "eos") == ends_document


def test_decoded_content_is_the_source_text(fixture_corpus: Path, shards: list) -> None:
    sources = {
        m["content"]
        for path in sorted((Path(__file__).parent / "fixtures" / "tr_chat").glob("*.jsonl"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip() and "messages" in (record := json.loads(line))
        for m in record["messages"]
    }
    decode = corpus_decoder(fixture_corpus)
    assert decode is not None
    view = window_view(shards, 0)
    contents = [
        r
        for p in view.pieces
        for r in p.runs
        if r.part == "content" and p.target_from == 0 and r.target
    ]
    assert contents
    for run in contents[:5]:
        assert decode(run.token_ids) in sources


def test_plan_rows_list_every_piece(shards: list) -> None:
    rows = list(iter_plan_rows(shards))
    assert [r["window"] for r in rows] == list(range(sum(s.plan.counts.windows for s in shards)))
    for s in shards:
        mine = [p for r in rows if r["shard"] == s.shard_id for p in r["pieces"]]
        pieces = s.plan.pieces
        assert [p["doc"] for p in mine] == pieces["doc"].tolist()
        assert [p["target_from"] for p in mine] == pieces["target_from"].tolist()
        assert [p["end"] - p["start"] for p in mine] == (pieces["end"] - pieces["start"]).tolist()


def test_document_windows(shards: list) -> None:
    first = shards[0]
    pieces = first.plan.pieces
    docs, counts = np.unique(pieces["doc"], return_counts=True)
    chained = int(docs[np.argmax(counts)])  # the document split into the most windows
    windows = document_windows(shards, chained)
    assert len(windows) == counts.max() > 1
    for w in windows:
        assert chained in [p.doc for p in window_view(shards, w).pieces]
    total_docs = sum(len(s.shard.index) for s in shards)
    with pytest.raises(InspectError, match=f"the corpus has {total_docs} documents"):
        document_windows(shards, total_docs)
    with pytest.raises(InspectError, match="does not exist"):
        window_view(shards, sum(s.plan.counts.windows for s in shards))
