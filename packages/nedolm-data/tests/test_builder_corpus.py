"""The builder on real Turkish data, checked against a slow reference built on another library.

The corpus is encoded with ``tokenizers`` (tokenizer.json); the reference re-encodes every
message with ``sentencepiece`` (the same mistral_v1 model), lays documents out by hand from
SPEC §2 and deals kept documents round-robin, then every shard must match it exactly.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil

import numpy as np
import pytest
import sentencepiece

from nedolm.data.builder import BuildError, BuildOptions, build_corpus
from nedolm.data.contract import validate_dataset_contract
from nedolm.data.format import discover_shards, read_special_tokens
from nedolm.data.verify import check_corpus

SEQ_LEN = 1024
ROLES = {"system": 0, "user": 1, "assistant": 2}
HEADERS = {0: "sistem\n", 1: "kullanici\n", 2: "asistan\n"}


def reference_documents(inputs, sp_path, seq_len):
    """(doc_key, tokens, segments, kept) per non-blank input line, in input order."""
    sp = sentencepiece.SentencePieceProcessor(model_proto=gzip.decompress(sp_path.read_bytes()))
    headers = {role: sp.encode(text) for role, text in HEADERS.items()}
    for path in inputs:
        for line_no, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
            if not raw.strip():
                continue
            record = json.loads(raw)
            if "messages" in record:
                messages = [
                    (ROLES[m["role"]], m["content"], m["role"] == "assistant")
                    for m in record["messages"]
                ]
            else:
                user = record["instruction"]
                if record.get("input"):
                    user += "\n\n" + record["input"]
                messages = [(1, user, False), (2, record["output"], True)]
            tokens, segments = [], []
            for role, text, trainable in messages:
                content = sp.encode(text)
                header = headers[role]
                segments.append(
                    (len(tokens), len(header) + len(content) + 2, len(header) + 1, role, trainable)
                )
                tokens += [32000, *header, *content, 32001]
            tokens.append(2)
            kept = all(length <= seq_len + 1 for _, length, *_ in segments)
            yield _key(path.name, record.get("id", f"line:{line_no}")), tokens, segments, kept


def shard_documents(shard):
    for row in shard.index:
        start, n = int(row["token_start"]), int(row["token_len"])
        seg = shard.segments[
            int(row["segment_start"]) : int(row["segment_start"]) + int(row["segment_count"])
        ]
        yield (
            int(row["doc_key"]),
            shard.tokens[start : start + n].tolist(),
            [tuple(int(v) for v in s) for s in seg],
        )


def test_corpus_matches_the_sentencepiece_reference_exactly(
    fixture_corpus, tr_chat_inputs, sentencepiece_model
):
    reference = list(reference_documents(tr_chat_inputs, sentencepiece_model, SEQ_LEN))
    kept = [doc for doc in reference if doc[3]]
    shards = discover_shards(fixture_corpus)
    assert len(shards) == 2
    built = [list(shard_documents(s)) for s in shards]
    for i, (key, tokens, segments, _) in enumerate(kept):
        got_key, got_tokens, got_segments = built[i % 2][i // 2]  # round-robin in input order
        assert got_key == key
        assert got_tokens == tokens
        assert got_segments == [(s, n, h, r, int(t)) for s, n, h, r, t in segments]
    assert sum(len(b) for b in built) == len(kept)
    assert read_special_tokens(fixture_corpus).vocab_size == 32003


def test_every_record_is_accounted_for(
    tmp_path, tr_chat_inputs, tokenizer_json, sentencepiece_model
):
    report = build_corpus(
        tr_chat_inputs, tokenizer_json, tmp_path / "c", BuildOptions(seq_len=SEQ_LEN)
    )
    lines = {
        p.name: sum(1 for raw in p.read_bytes().split(b"\n") if raw.strip()) for p in tr_chat_inputs
    }
    assert {s.name: s.records for s in report.sources} == lines
    for source in report.sources:
        assert source.kept + sum(source.dropped.values()) == source.records
    reference = list(reference_documents(tr_chat_inputs, sentencepiece_model, SEQ_LEN))
    assert report.documents == sum(doc[3] for doc in reference)
    assert report.dropped == {"message_too_long": 2}  # two 1,000+ token paragraphs of context
    manifest = json.loads((tmp_path / "c" / "SHARD_MANIFEST.json").read_text(encoding="utf-8"))
    assert [s["records"] for s in manifest["build"]["sources"]] == [
        s.records for s in report.sources
    ]


def _key(name, record_id):
    digest = hashlib.blake2b(f"{name}\0{record_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def test_alpaca_and_chat_versions_of_the_seed_tasks_encode_the_same(fixture_corpus):
    documents = {
        key: tokens
        for s in discover_shards(fixture_corpus)
        for key, tokens, _ in shard_documents(s)
    }
    for k in range(10):
        alpaca = documents[_key("seed_tasks_tr.alpaca.jsonl", f"seed_task_{k}")]
        assert alpaca == documents[_key("seed_tasks_tr.jsonl", f"seed_task_{k}")]


def test_built_corpus_passes_verify_and_the_trainer_gate(fixture_corpus):
    assert check_corpus(fixture_corpus) == []
    gate = validate_dataset_contract(fixture_corpus, vocab_size=32003, seq_len=SEQ_LEN)
    assert gate["documents"] == sum(len(s.index) for s in discover_shards(fixture_corpus))
    assert gate["validation_shard_ids"] == [1]
    assert gate["message_start_id"] == 32000 and gate["message_end_id"] == 32001


def _tree(root):
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_worker_pool_and_in_process_builds_are_byte_identical(
    tmp_path, tr_chat_inputs, tokenizer_json
):
    options = {"seq_len": SEQ_LEN, "shards": 3, "val_fraction": 0.3, "chunk_records": 7}
    build_corpus(tr_chat_inputs, tokenizer_json, tmp_path / "a", BuildOptions(**options, workers=1))
    build_corpus(tr_chat_inputs, tokenizer_json, tmp_path / "b", BuildOptions(**options, workers=2))
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")
    manifest = json.loads((tmp_path / "a" / "SHARD_MANIFEST.json").read_text(encoding="utf-8"))
    assert manifest["validation_shard_ids"] == [2]


def test_identical_rebuild_keeps_out_and_a_different_corpus_is_refused(
    tmp_path, tr_chat_inputs, tokenizer_json
):
    out = tmp_path / "c"
    build_corpus(tr_chat_inputs, tokenizer_json, out, BuildOptions(seq_len=SEQ_LEN))
    before = _tree(out)
    again = build_corpus(tr_chat_inputs, tokenizer_json, out, BuildOptions(seq_len=SEQ_LEN))
    assert again.identical_rebuild and _tree(out) == before
    with pytest.raises(BuildError, match="holds a different corpus; pass --overwrite"):
        build_corpus(tr_chat_inputs, tokenizer_json, out, BuildOptions(seq_len=2048))
    assert _tree(out) == before
    replaced = build_corpus(
        tr_chat_inputs, tokenizer_json, out, BuildOptions(seq_len=2048, overwrite=True)
    )
    assert not replaced.identical_rebuild
    assert (
        json.loads((out / "PACKING_POLICY_ADAPTIVE_AUDIT.json").read_text(encoding="utf-8"))[
            "seq_len"
        ]
        == 2048
    )
    assert check_corpus(out) == []
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # no temporary or old directories left


def test_out_that_is_not_a_corpus_is_never_replaced(tmp_path, tr_chat_inputs, tokenizer_json):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me", encoding="utf-8")
    with pytest.raises(BuildError, match="holds no corpus; refusing"):
        build_corpus(
            tr_chat_inputs,
            tokenizer_json,
            tmp_path / "mine",
            BuildOptions(seq_len=SEQ_LEN, overwrite=True),
        )
    (tmp_path / "file").write_text("x", encoding="utf-8")
    with pytest.raises(BuildError, match="not a directory"):
        build_corpus(
            tr_chat_inputs, tokenizer_json, tmp_path / "file", BuildOptions(seq_len=SEQ_LEN)
        )
    assert (tmp_path / "mine" / "notes.txt").read_text(encoding="utf-8") == "keep me"


def test_shard_tokens_fills_shards_in_order(tmp_path, tr_chat_inputs, tokenizer_json):
    report = build_corpus(
        tr_chat_inputs,
        tokenizer_json,
        tmp_path / "c",
        BuildOptions(seq_len=SEQ_LEN, shard_tokens=10_000),
    )
    shards = discover_shards(tmp_path / "c")
    assert report.shards == len(shards) > 2
    sizes = [len(s.tokens) for s in shards]
    assert all(size >= 10_000 for size in sizes[:-1])
    # each shard starts a new document once the previous one reached the size
    assert all(
        size - int(s.index["token_len"][-1]) < 10_000 for s, size in zip(shards, sizes, strict=True)
    )
    assert check_corpus(tmp_path / "c") == []


def test_more_shards_than_documents_is_an_error(tmp_path, tr_chat_inputs, tokenizer_json):
    with pytest.raises(BuildError, match="fewer than the 500 shards"):
        build_corpus(
            tr_chat_inputs[:1],
            tokenizer_json,
            tmp_path / "c",
            BuildOptions(seq_len=SEQ_LEN, shards=500),
        )
    assert not (tmp_path / "c").exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"seq_len": 0}, "--seq-len must be positive"),
        ({"seq_len": 8, "shards": 2, "shard_tokens": 5}, "either --shards or --shard-tokens"),
        (
            {"seq_len": 8, "val_shards": (1,), "val_fraction": 0.5},
            "either --val-shards or --val-fraction",
        ),
        ({"seq_len": 8, "val_fraction": 1.5}, r"must be in \[0, 1\)"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(BuildError, match=message):
        BuildOptions(**options)


def test_validation_ids_must_leave_training_shards():
    with pytest.raises(BuildError, match="none left to train on"):
        BuildOptions(seq_len=8, val_shards=(0,)).validation_ids(1)
    with pytest.raises(BuildError, match=r"outside 0..1"):
        BuildOptions(seq_len=8, val_shards=(5,)).validation_ids(2)


def test_default_split_holds_out_a_shard(tmp_path, tr_chat_inputs, tokenizer_json):
    """No shard options: 20 shards, the last held out (5%), recorded in the manifest the
    trainer reads; a corpus of fewer documents gets one shard per document, a corpus of one
    shard nothing held out, and val_fraction=0 opts out."""
    report = build_corpus(
        tr_chat_inputs, tokenizer_json, tmp_path / "a", BuildOptions(seq_len=4096)
    )
    assert (report.shards, report.validation_shard_ids) == (20, [19])
    vocab_size = read_special_tokens(tmp_path / "a").vocab_size
    contract = validate_dataset_contract(tmp_path / "a", vocab_size, 4096)  # the trainer's gate
    assert contract["validation_shard_ids"] == [19]
    assert len(discover_shards(tmp_path / "a")) == 20

    three = tmp_path / "three.jsonl"
    three.write_text("".join(tr_chat_inputs[0].read_text(encoding="utf-8").splitlines(True)[:3]))
    small = build_corpus([three], tokenizer_json, tmp_path / "b", BuildOptions(seq_len=4096))
    assert (small.shards, small.validation_shard_ids, small.documents) == (3, [2], 3)
    assert check_corpus(tmp_path / "b") == []
    one = BuildOptions(seq_len=4096, shards=1)
    assert build_corpus([three], tokenizer_json, tmp_path / "c", one).validation_shard_ids == []

    opted_out = BuildOptions(seq_len=4096, val_fraction=0)
    report = build_corpus(tr_chat_inputs, tokenizer_json, tmp_path / "d", opted_out)
    assert (report.shards, report.validation_shard_ids) == (20, [])
    eight = BuildOptions(seq_len=4096, shards=8)
    assert eight.validation_ids(8) == [7]  # 5% of 8 shards, at least one
    assert BuildOptions(seq_len=4096, shards=8, val_fraction=0.3).validation_ids(8) == [5, 6, 7]
    assert BuildOptions(seq_len=4096, val_fraction=0.07).validation_ids(100) == list(range(93, 100))
    with pytest.raises(BuildError, match=r"\[25\] outside 0..19"):  # before any work
        build_corpus([three], tokenizer_json, tmp_path / "e", BuildOptions(4096, val_shards=(25,)))
    assert not (tmp_path / "e").exists()


def test_copied_corpus_still_verifies(tmp_path, fixture_corpus):
    shutil.copytree(fixture_corpus, tmp_path / "copy")
    assert check_corpus(tmp_path / "copy") == []
    np.testing.assert_array_equal(
        discover_shards(tmp_path / "copy")[0].tokens, discover_shards(fixture_corpus)[0].tokens
    )


def test_bad_validation_ids_are_refused_before_any_work(tmp_path, tr_chat_inputs, tokenizer_json):
    options = BuildOptions(seq_len=SEQ_LEN, shards=2, val_shards=(5,))
    with pytest.raises(BuildError, match=r"validation shard ids \[5\] outside 0..1"):
        build_corpus(tr_chat_inputs, tokenizer_json, tmp_path / "c", options)
    assert list(tmp_path.iterdir()) == []
