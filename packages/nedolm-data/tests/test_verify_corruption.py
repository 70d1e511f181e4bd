"""The verifier on damaged corpora: every flipped byte, truncation, deletion or contract edit
is reported, naming the file."""

from __future__ import annotations

import json
import shutil

import msgspec
import numpy as np
import pytest

from nedolm.data.format import HEADER_BYTES, Shard, write_array
from nedolm.data.verify import check_corpus, verify_corpus

KINDS = ("tokens", "segments", "index")


def _shard(corpus, shard_id=0):
    return Shard.in_dir(corpus / "shards", shard_id, 2)


def _path(corpus, kind, shard_id=0):
    return dict(zip(KINDS, _shard(corpus, shard_id).paths, strict=True))[kind]


def _problems_naming(corpus, name):
    problems = check_corpus(corpus)
    assert problems, "damage went unnoticed"
    assert any(name in p for p in problems), problems
    return problems


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["header", "first record", "middle", "last byte"])
def test_flipped_byte_is_named(corpus, kind, where):
    path = _path(corpus, kind)
    data = bytearray(path.read_bytes())
    offset = {
        "header": 20,
        "first record": HEADER_BYTES,
        "middle": len(data) // 2,
        "last byte": len(data) - 1,
    }[where]
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    _problems_naming(corpus, path.name)


@pytest.mark.parametrize("kind", KINDS)
def test_truncated_file_is_named(corpus, kind):
    path = _path(corpus, kind, shard_id=1)
    path.write_bytes(path.read_bytes()[:-4])
    problems = _problems_naming(corpus, path.name)
    # partial totals over the readable shards are not compared: no noise about other files
    assert all(path.name in p for p in problems), problems


@pytest.mark.parametrize("kind", KINDS)
def test_deleted_file_is_named(corpus, kind):
    path = _path(corpus, kind, shard_id=1)
    path.unlink()
    _problems_naming(corpus, path.name)


def test_deleted_whole_shard_is_reported(corpus):
    for path in _shard(corpus, 1).paths:
        path.unlink()
    _problems_naming(corpus, "missing [1]")


def test_extra_unlisted_shard_file_is_reported(corpus):
    shutil.copy(_path(corpus, "tokens"), corpus / "shards" / "sft-00002-of-00002.tokens.bin")
    _problems_naming(corpus, "sft-00002-of-00002")


def _edit_json(path, edit):
    doc = json.loads(path.read_text(encoding="utf-8"))
    edit(doc)
    path.write_text(json.dumps(doc, indent=2, sort_keys=True), encoding="utf-8")


def _set(key, value):
    return lambda doc: doc.__setitem__(key, value)


@pytest.mark.parametrize(
    ("file_name", "edit", "expected"),
    [
        ("FINAL_BINARY_VERIFY_REPORT.json", _set("documents", 1), "'documents'"),
        ("FINAL_BINARY_VERIFY_REPORT.json", _set("status", "PASS!"), "'status'"),
        (
            "FINAL_BINARY_VERIFY_REPORT.json",
            lambda d: d.pop("header_schema_verified"),
            "header_schema_verified",
        ),
        ("PACKING_POLICY_ADAPTIVE_AUDIT.json", _set("windows", 3), "'windows'"),
        (
            "PACKING_POLICY_ADAPTIVE_AUDIT.json",
            _set("hard_continuations", 1),
            "'hard_continuations'",
        ),
        ("PACKING_POLICY_ADAPTIVE_AUDIT.json", _set("seq_len", "x"), "seq_len 'x'"),
        (
            "SHARD_MANIFEST.json",
            lambda d: d["files"][0].__setitem__("sha256", "0" * 64),
            "sft-00000-of-00002.tokens.bin",
        ),
        (
            "SHARD_MANIFEST.json",
            lambda d: d["files"].pop(),
            "does not list shards/sft-00001-of-00002.index.bin",
        ),
        ("SHARD_MANIFEST.json", _set("aggregate_sha256", "0" * 64), "aggregate_sha256"),
        ("SHARD_MANIFEST.json", _set("validation_shard_ids", [7]), "validation_shard_ids"),
        (
            "SHARD_MANIFEST.json",
            lambda d: d["build"]["content_sha256"].reverse(),
            "build.content_sha256[0] differs from shard 0's content digest",
        ),
        ("SPECIAL_TOKENS.json", _set("eos_id", 3), "SPECIAL_TOKENS.json"),
        ("SPECIAL_TOKENS.json", _set("roles", {"user": "user"}), "SPECIAL_TOKENS.json"),
        (
            "SPECIAL_TOKENS.json",
            lambda d: d["role_header_token_ids"]["user"].append(5),
            "SPECIAL_TOKENS.json",
        ),
    ],
)
def test_edited_contract_file_is_named(corpus, file_name, edit, expected):
    _edit_json(corpus / file_name, edit)
    problems = check_corpus(corpus)
    assert any(expected in p for p in problems), problems
    assert any(file_name in p for p in problems) or file_name == "SHARD_MANIFEST.json", problems


@pytest.mark.parametrize("file_name", ["FINAL_BINARY_VERIFY_REPORT.json", "SHARD_MANIFEST.json"])
def test_deleted_or_garbled_contract_file(corpus, file_name):
    (corpus / file_name).write_text("{not json", encoding="utf-8")
    _problems_naming(corpus, file_name)
    (corpus / file_name).unlink()
    _problems_naming(corpus, file_name)


def test_changed_tokenizer_copy_is_reported(corpus):
    (corpus / "tokenizer" / "mistral_v1.tokenizer.json.gz").write_bytes(b"not the tokenizer")
    _problems_naming(corpus, "turkish_user_header_verified")


def _rewrite_shard(corpus, tokens=None, segments=None, index=None):
    """Replace shard 0's arrays with valid files (headers right, content wrong)."""
    shard = _shard(corpus)
    for kind, path, array in zip(KINDS, shard.paths, (tokens, segments, index), strict=True):
        if array is not None:
            write_array(path, kind, array)


def _facts(corpus):
    manifest = json.loads((corpus / "SHARD_MANIFEST.json").read_text(encoding="utf-8"))
    return verify_corpus(corpus, 1024, manifest["build"]["content_sha256"])


def test_swapped_content_token_breaks_only_the_content_check(corpus):
    shard = _shard(corpus)
    tokens = np.array(shard.tokens)
    seg = shard.segments[0]
    position = int(seg["start"] + seg["header_len"])  # first content token of document 0
    tokens[position] = 1000 if tokens[position] != 1000 else 1001
    _rewrite_shard(corpus, tokens=tokens)
    result = _facts(corpus)
    failed = [k for k, v in msgspec.structs.asdict(result.report).items() if v is False]
    assert failed == ["content_tokens_exact_vs_source"]


def test_control_token_inside_content_is_caught(corpus):
    shard = _shard(corpus)
    tokens = np.array(shard.tokens)
    seg = shard.segments[0]
    tokens[int(seg["start"] + seg["header_len"])] = 32001  # a <|mesaj_bitir|> in content
    _rewrite_shard(corpus, tokens=tokens)
    result = _facts(corpus)
    assert result.report.structural_control_counts_verified is False
    assert any("<|mesaj_bitir|> occurs" in p for p in result.problems)


def test_trainable_user_message_breaks_the_assistant_only_contract(corpus):
    segments = np.array(_shard(corpus).segments)
    user = int(np.flatnonzero(segments["role"] == 1)[0])
    segments["trainable"][user] = 1
    _rewrite_shard(corpus, segments=segments)
    result = _facts(corpus)
    assert result.report.assistant_only_trainable_contract_verified is False
    assert result.report.status == "FAIL"


def test_wrong_header_is_caught(corpus):
    shard = _shard(corpus)
    tokens = np.array(shard.tokens)
    seg = shard.segments[0]
    tokens[int(seg["start"]) + 1] += 1  # first header token of document 0's first message
    _rewrite_shard(corpus, tokens=tokens)
    result = _facts(corpus)
    assert result.report.header_schema_verified is False


def test_broken_offsets_are_caught_and_skip_dependent_checks(corpus):
    index = np.array(_shard(corpus).index)
    index["token_start"][1] += 1
    _rewrite_shard(corpus, index=index)
    result = _facts(corpus)
    assert result.report.offsets_lengths_exact is False
    assert any("token_start not contiguous (first bad document 1)" in p for p in result.problems)


def test_duplicate_doc_keys_across_shards(corpus):
    other = np.array(_shard(corpus, 1).index)
    index = np.array(_shard(corpus).index)
    index["doc_key"][0] = other["doc_key"][0]
    _rewrite_shard(corpus, index=index)
    assert _facts(corpus).report.global_doc_keys_unique is False


def test_out_of_range_token_id(corpus):
    shard = _shard(corpus)
    tokens = np.array(shard.tokens)
    seg = shard.segments[0]
    tokens[int(seg["start"] + seg["header_len"])] = 40000
    _rewrite_shard(corpus, tokens=tokens)
    result = _facts(corpus)
    assert result.report.token_id_range_verified is False
    assert result.report.max_token_id == 40000


def test_pristine_copy_has_no_problems(corpus):
    assert check_corpus(corpus) == []
