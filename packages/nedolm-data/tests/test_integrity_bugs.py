"""Regression tests for issue 15's builder and verifier bugs 3-6 (bug 2 is the trainer's:
packages/nedolm-train/tests/test_contract.py). Each failed on the code before the fix."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.contract import DatasetContractError, hash_entries, validate_dataset_contract
from nedolm.data.format import discover_shards, read_array, write_array
from nedolm.data.sources import InputError, RecordPolicy
from nedolm.data.verify import check_corpus

MANIFEST = "SHARD_MANIFEST.json"


@pytest.fixture
def corpus(tmp_path, fixture_corpus):
    return shutil.copytree(fixture_corpus, tmp_path / "data")


def _edit_json(path, edit):
    doc = json.loads(path.read_text(encoding="utf-8"))
    edit(doc)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True), encoding="utf-8")


def _write_chats(path, *conversations):
    path.write_text(
        "".join(
            json.dumps({"messages": [{"role": r, "content": c} for r, c in conv]}) + "\n"
            for conv in conversations
        ),
        encoding="utf-8",
    )
    return path


def _both_refuse(corpus, needle, gate_needle=None):
    """check_corpus reports ``needle``; the trainer's gate refuses with ``gate_needle`` (by
    default ``needle``) in its first problem."""
    problems = check_corpus(corpus)
    assert any(needle in p for p in problems), problems
    with pytest.raises(DatasetContractError, match=re.escape(gate_needle or needle)):
        validate_dataset_contract(corpus, _vocab(corpus), 1024)
    return problems


def _vocab(corpus):
    return json.loads((corpus / "SPECIAL_TOKENS.json").read_text())["vocab_size"]


# Bug 3: the manifest's build block is re-checked.


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (
            lambda b: b["sources"][0].__setitem__("records", b["sources"][0]["records"] + 1000),
            "records",
        ),
        (lambda b: b["sources"][0]["dropped"].__setitem__("invalid_json", 3), "dropped"),
        (lambda b: b.__setitem__("tokenizer_sha256", "0" * 64), "tokenizer_sha256"),
    ],
)
def test_build_block_is_rechecked(corpus, edit, needle):
    _edit_json(corpus / MANIFEST, lambda d: edit(d["build"]))
    problems = _both_refuse(corpus, needle)
    assert all(MANIFEST in p for p in problems if needle in p), problems


# Bug 4: content that encodes to zero tokens is empty content.


@pytest.fixture(scope="session")
def tanai(fixtures_dir):
    """The tanai tokenizer.json: encodes a zero-width space to nothing and reads "<s>" as BOS."""
    return fixtures_dir / "tokenizer" / "tanai.tokenizer.json.gz"


def test_zero_token_content_is_empty(tmp_path, tanai):
    good = [("user", "Merhaba"), ("assistant", "Selam!")]
    path = _write_chats(
        tmp_path / "chats.jsonl", good, [("user", "Soru?"), ("assistant", "\u200b")]
    )
    with pytest.raises(InputError, match=r"chats\.jsonl:2: messages\[1\]: content encodes to no"):
        build_corpus([path], tanai, tmp_path / "out", BuildOptions(seq_len=64))
    drop = BuildOptions(seq_len=64, policy=RecordPolicy(invalid_records="drop"))
    report = build_corpus([path], tanai, tmp_path / "out", drop)
    assert report.sources[0].dropped == {"empty_content": 1}


# Bug 5: no id the tokenizer marks special inside content.


@pytest.mark.parametrize("text", ["<s>", "a <s> b", "<unk>", "<pad>"])
def test_special_token_text_never_becomes_a_special_id(tmp_path, tanai, text):
    path = _write_chats(
        tmp_path / "chats.jsonl",
        [("user", "Merhaba"), ("assistant", "Selam!")],
        [("user", f"Bu ne: {text}"), ("assistant", "Bir etiket.")],
    )
    with pytest.raises(InputError, match=r"chats\.jsonl:2: messages\[0\] encodes to the special"):
        build_corpus([path], tanai, tmp_path / "out", BuildOptions(seq_len=64))
    drop = BuildOptions(seq_len=64, policy=RecordPolicy(invalid_records="drop"))
    report = build_corpus([path], tanai, tmp_path / "out", drop)
    assert report.sources[0].dropped == {"special_token_in_content": 1}


def _rewrite_tokens(corpus, edit):
    """Edit shard 0's tokens and re-hash the manifest to match (a deliberate, consistent edit)."""
    shard = discover_shards(corpus)[0]
    tokens = np.array(read_array(shard.token_path, "tokens"))
    edit(tokens, read_array(shard.segments_path, "segments"))
    write_array(shard.token_path, "tokens", tokens)
    rehash_manifest(corpus)
    return shard.token_path.name


def rehash_manifest(corpus):
    from nedolm.data.contract import aggregate_sha256

    def rehash(doc):
        files = hash_entries(corpus, [corpus / e["path"] for e in doc["files"]])
        doc["files"] = [{"path": e.path, "sha256": e.sha256, "size": e.size} for e in files]
        doc["aggregate_sha256"] = aggregate_sha256(doc["files"])

    _edit_json(corpus / MANIFEST, rehash)


def test_verify_finds_a_special_id_inside_content(corpus):
    def bos_into_content(tokens, segments):
        first_content = int(segments["header_len"][0])  # message 0: start token + header
        tokens[first_content] = 1  # mistral_v1's <s>, a special token of the tokenizer

    name = _rewrite_tokens(corpus, bos_into_content)
    problems = _both_refuse(corpus, "special id 1", gate_needle=name)
    assert any(name in p and "special id 1" in p for p in problems), problems


# Bug 6: verify blames the file at fault.


def test_edited_content_digest_blames_the_manifest_not_the_tokens(corpus):
    _edit_json(corpus / MANIFEST, lambda d: d["build"]["content_sha256"].__setitem__(0, "0" * 64))
    problems = _both_refuse(corpus, "build.content_sha256")
    assert not any("tokens.bin" in p for p in problems), problems
    assert all(p.startswith(MANIFEST) for p in problems), problems


@pytest.mark.parametrize("kind", ["tokens", "segments", "index"])
def test_shard_problems_name_which_of_the_three_files(corpus, kind):
    shard = discover_shards(corpus)[0]
    path = {"tokens": shard.token_path, "segments": shard.segments_path, "index": shard.index_path}[
        kind
    ]
    array = np.array(read_array(path, kind))
    if kind == "tokens":
        array[-1] = 5  # the last EOS
    elif kind == "segments":
        array["trainable"][0] = True  # message 0 is the user's
    else:
        array["token_len"][0] += 1
    write_array(path, kind, array)
    rehash_manifest(corpus)
    problems = check_corpus(corpus)
    shard_problems = [p for p in problems if "sft-00000" in p]
    assert shard_problems and all(path.name in p for p in shard_problems), problems
