"""Regression tests for issue 15's builder and verifier bugs 3-6 (bug 2 is the trainer's:
packages/nedolm-train/tests/test_contract.py). Each failed on the code before the fix."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from nedolm.data.builder import BuildError, BuildOptions, build_corpus
from nedolm.data.contract import (
    REQUIRED_TRUE,
    DatasetContractError,
    PackingAudit,
    ShardManifest,
    VerifyReport,
    aggregate_sha256,
    hash_entries,
    validate_dataset_contract,
)
from nedolm.data.format import SpecialTokens, discover_shards, read_array, write_array
from nedolm.data.inputs import bounded_lines
from nedolm.data.records import ROLE_ASSISTANT, ROLE_SYSTEM, ROLE_USER
from nedolm.data.sources import InputError, RecordPolicy, parse_record
from nedolm.data.verify import check_corpus

MANIFEST = "SHARD_MANIFEST.json"


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


@pytest.mark.parametrize("text", ["<s>", "a <s> b", "</s>", "<pad>"])
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


# The mutation suite: each edit makes both verify and the trainer's start gate refuse, naming
# the file at fault. Shard edits marked "rehashed" also re-hash the manifest, so only the
# recomputation from the binaries can catch them.

REPORT, AUDIT, SPECIAL = (
    "FINAL_BINARY_VERIFY_REPORT.json",
    "PACKING_POLICY_ADAPTIVE_AUDIT.json",
    "SPECIAL_TOKENS.json",
)
SHARD0 = "sft-00000-of-00002"


def _shard_file(corpus, kind):
    return corpus / "shards" / f"{SHARD0}.{kind}.bin"


def _flip(kind, where):
    def mutate(corpus):
        path = _shard_file(corpus, kind)
        raw = bytearray(path.read_bytes())
        raw[where] ^= 0x01
        path.write_bytes(bytes(raw))

    return mutate


def _truncate(kind):
    return lambda c: _shard_file(c, kind).write_bytes(_shard_file(c, kind).read_bytes()[:-3])


def _append(kind):
    return lambda c: _shard_file(c, kind).write_bytes(_shard_file(c, kind).read_bytes() + b"\0")


def _delete(kind):
    return lambda c: _shard_file(c, kind).unlink()


def _rehashed(kind, edit):
    """Rewrite shard 0's ``kind`` array through ``edit(array, segments, index)``, a valid
    file, and re-hash the manifest to match."""

    def mutate(corpus):
        shard = discover_shards(corpus)[0]
        arrays = {
            k: np.array(read_array(p, k))
            for k, p in zip(("tokens", "segments", "index"), shard.paths, strict=True)
        }
        edit(arrays[kind], arrays["segments"], arrays["index"])
        write_array(_shard_file(corpus, kind), kind, arrays[kind])
        rehash_manifest(corpus)

    return mutate


def _content_position(segments, message=0):
    starts = np.cumsum(segments["length"].astype(np.int64)) - segments["length"]
    return int(starts[message] + segments["header_len"][message])


def _merge_documents(tokens, _segments, index):
    """Remove document 0's EOS: documents 0 and 1 would share attention."""
    tokens[int(index["token_len"][0]) - 1] = tokens[1]


def _set_field(field, value):
    return lambda array, *_: array[field].__setitem__(0, value)


def _json(file_name, edit):
    return lambda corpus: _edit_json(corpus / file_name, edit)


def _bump(key, by=1):
    return lambda d: d.__setitem__(key, d[key] + by)


def _set_key(key, value):
    return lambda d: d.__setitem__(key, value)


def _in(path, edit):
    """Apply ``edit`` to the nested dict at ``path`` (keys and list indices)."""

    def nested(doc):
        for step in path:
            doc = doc[step]
        edit(doc)

    return nested


TOKENS, SEGMENTS, INDEX = (f"{SHARD0}.{k}.bin" for k in ("tokens", "segments", "index"))
MUTATIONS = {
    # every shard file kind: bytes flipped, truncated, grown, deleted
    **{
        f"{k}-flip-header": (_flip(k, 10), f"{SHARD0}.{k}.bin")
        for k in ("tokens", "segments", "index")
    },
    **{
        f"{k}-flip-payload": (_flip(k, -2), f"{SHARD0}.{k}.bin")
        for k in ("tokens", "segments", "index")
    },
    **{
        f"{k}-truncated": (_truncate(k), f"{SHARD0}.{k}.bin")
        for k in ("tokens", "segments", "index")
    },
    **{f"{k}-grown": (_append(k), f"{SHARD0}.{k}.bin") for k in ("tokens", "segments", "index")},
    **{f"{k}-deleted": (_delete(k), f"{SHARD0}.{k}.bin") for k in ("tokens", "segments", "index")},
    # consistent rewrites (manifest re-hashed): only the recomputation catches these
    "tokens-eos-removed-documents-merge": (_rehashed("tokens", _merge_documents), TOKENS),
    "tokens-message-start-replaced": (
        _rehashed("tokens", lambda t, *_: t.__setitem__(0, 5)),
        TOKENS,
    ),
    "tokens-header-token-changed": (_rehashed("tokens", lambda t, *_: t.__setitem__(1, 5)), TOKENS),
    "tokens-bos-in-content": (
        _rehashed("tokens", lambda t, s, _i: t.__setitem__(_content_position(s), 1)),
        TOKENS,
    ),
    "tokens-content-token-changed": (
        _rehashed("tokens", lambda t, s, _i: t.__setitem__(_content_position(s), 5)),
        TOKENS,
    ),
    "tokens-pad-in-content": (
        _rehashed("tokens", lambda t, s, _i: t.__setitem__(_content_position(s), 32002)),
        TOKENS,
    ),
    "segments-user-trainable": (_rehashed("segments", _set_field("trainable", True)), SEGMENTS),
    "segments-unknown-role": (_rehashed("segments", _set_field("role", 7)), SEGMENTS),
    "segments-header-len": (_rehashed("segments", _set_field("header_len", 1)), SEGMENTS),
    "segments-length": (
        _rehashed("segments", lambda s, *_: s["length"].__setitem__(0, s["length"][0] + 1)),
        SEGMENTS,
    ),
    "index-token-len": (
        _rehashed("index", lambda i, *_: i["token_len"].__setitem__(0, i["token_len"][0] + 1)),
        INDEX,
    ),
    "index-segment-count": (
        _rehashed(
            "index", lambda i, *_: i["segment_count"].__setitem__(0, i["segment_count"][0] + 1)
        ),
        INDEX,
    ),
    "index-token-start": (
        _rehashed("index", lambda i, *_: i["token_start"].__setitem__(1, 0)),
        INDEX,
    ),
    "index-duplicate-doc-key": (
        _rehashed("index", lambda i, *_: i["doc_key"].__setitem__(1, i["doc_key"][0])),
        INDEX,
    ),
    "extra-unlisted-shard-file": (
        lambda c: (c / "shards" / "sft-00009-of-00002.tokens.bin").write_bytes(
            _shard_file(c, "tokens").read_bytes()
        ),
        "sft-00009-of-00002",
    ),
    # the tokenizer copy
    "tokenizer-copy-changed": (
        lambda c: (c / "tokenizer" / "mistral_v1.tokenizer.json.gz").write_bytes(b"other"),
        "tokenizer/mistral_v1.tokenizer.json.gz",
    ),
    "tokenizer-copy-deleted": (
        lambda c: (c / "tokenizer" / "mistral_v1.tokenizer.json.gz").unlink(),
        "tokenizer/mistral_v1.tokenizer.json.gz",
    ),
    # FINAL_BINARY_VERIFY_REPORT.json: every key
    **{
        f"report-{key}": (_json(REPORT, _bump(key)), REPORT)
        for key in (
            "shards",
            "documents",
            "messages",
            "trainable_messages",
            "tokens_including_eos",
            "max_token_id",
            "vocab_size",
            "eos_id",
            "pad_id",
            "message_start_id",
            "message_end_id",
        )
    },
    **{
        f"report-{key}": (_json(REPORT, _set_key(key, False)), REPORT)
        for key in (*REQUIRED_TRUE, "packing_plan_verified")
    },
    "report-schema": (_json(REPORT, _set_key("schema", "v0")), REPORT),
    "report-status": (_json(REPORT, _set_key("status", "FAIL")), REPORT),
    "report-messages_by_role": (_json(REPORT, _in(["messages_by_role"], _bump("user"))), REPORT),
    "report-special_tokens_sha256": (
        _json(REPORT, _set_key("special_tokens_sha256", "0" * 64)),
        REPORT,
    ),
    "report-content_sha256": (
        _json(REPORT, _in(["content_sha256"], lambda d: d.reverse())),
        REPORT,
    ),
    # PACKING_POLICY_ADAPTIVE_AUDIT.json: every key
    **{
        f"audit-{key}": (_json(AUDIT, _bump(key)), AUDIT)
        for key in (
            "documents",
            "raw_tokens",
            "windows",
            "assistant_target_tokens",
            "valid_context_tokens",
            "padded_tokens",
            "turn_aligned_continuations",
            "assistant_aligned_continuations",
            "hard_continuations",
            "read_span_tokens",
            "seq_len",
        )
    },
    **{
        f"audit-{key}": (_json(AUDIT, _set_key(key, "other")), AUDIT)
        for key in ("schema", "status", "packing_policy", "target_policy", "continuation_policy")
    },
    "audit-valid_context_ratio": (_json(AUDIT, _bump("valid_context_ratio", -0.01)), AUDIT),
    "audit-assistant_target_ratio": (_json(AUDIT, _bump("assistant_target_ratio", 0.01)), AUDIT),
    "audit-per_shard": (_json(AUDIT, _in(["per_shard", 0], _bump("windows"))), AUDIT),
    # SHARD_MANIFEST.json: every key the corpus can prove
    "manifest-schema": (_json(MANIFEST, _set_key("schema", "v0")), MANIFEST),
    "manifest-status": (_json(MANIFEST, _set_key("status", "FAIL")), MANIFEST),
    "manifest-algorithm": (_json(MANIFEST, _set_key("algorithm", "md5")), MANIFEST),
    "manifest-file_count": (_json(MANIFEST, _bump("file_count")), MANIFEST),
    "manifest-shard_count": (_json(MANIFEST, _bump("shard_count")), MANIFEST),
    "manifest-aggregate_sha256": (
        _json(MANIFEST, _set_key("aggregate_sha256", "0" * 64)),
        MANIFEST,
    ),
    "manifest-file-sha256": (
        _json(MANIFEST, _in(["files", 0], _set_key("sha256", "0" * 64))),
        MANIFEST,
    ),
    "manifest-file-size": (_json(MANIFEST, _in(["files", 0], _bump("size"))), MANIFEST),
    "manifest-file-path": (
        _json(MANIFEST, _in(["files", 0], _set_key("path", "shards/x.bin"))),
        MANIFEST,
    ),
    "manifest-validation_shard_ids": (
        _json(MANIFEST, _set_key("validation_shard_ids", [0])),
        MANIFEST,
    ),
    "manifest-validation_sha256": (
        _json(MANIFEST, _set_key("validation_sha256", "0" * 64)),
        MANIFEST,
    ),
    "manifest-build-records": (
        _json(MANIFEST, _in(["build", "sources", 0], _bump("records", 1000))),
        MANIFEST,
    ),
    "manifest-build-kept": (_json(MANIFEST, _in(["build", "sources", 0], _bump("kept"))), MANIFEST),
    "manifest-build-content_sha256": (
        _json(MANIFEST, _in(["build", "content_sha256"], lambda d: d.reverse())),
        MANIFEST,
    ),
    "manifest-build-tokenizer_sha256": (
        _json(MANIFEST, _in(["build"], _set_key("tokenizer_sha256", "0" * 64))),
        MANIFEST,
    ),
    # SPECIAL_TOKENS.json: every key
    **{
        f"special-{key}": (_json(SPECIAL, _bump(key)), SPECIAL)
        for key in ("eos_id", "pad_id", "message_start_id", "message_end_id", "vocab_size")
    },
    "special-schema": (_json(SPECIAL, _set_key("schema", "v0")), SPECIAL),
    "special-control_tokens": (
        _json(SPECIAL, _in(["control_tokens", 0], _set_key("token", "<x>"))),
        SPECIAL,
    ),
    "special-roles": (_json(SPECIAL, _in(["roles"], _set_key("user", "user"))), SPECIAL),
    "special-role_header_token_ids": (
        _json(SPECIAL, _in(["role_header_token_ids", "user"], lambda d: d.append(5))),
        SPECIAL,
    ),
    "special-tokenizer-sha256": (
        _json(SPECIAL, _in(["tokenizer"], _set_key("sha256", "0" * 64))),
        SPECIAL,
    ),
    "special-tokenizer-base_vocab_size": (
        _json(SPECIAL, _in(["tokenizer"], _bump("base_vocab_size"))),
        SPECIAL,
    ),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_mutation_is_refused_by_verify_and_the_gate_naming_the_file(corpus, name):
    mutate, blamed = MUTATIONS[name]
    vocab = _vocab(corpus)
    mutate(corpus)
    problems = check_corpus(corpus)
    assert problems and blamed in problems[0], problems
    with pytest.raises(DatasetContractError) as err:
        validate_dataset_contract(corpus, vocab, 1024)
    assert blamed in str(err.value), str(err.value)


def test_the_suite_covers_every_shard_kind_and_contract_key():
    assert len(MUTATIONS) >= 40
    assert all(
        any(n.startswith(f"{k}-") for n in MUTATIONS) for k in ("tokens", "segments", "index")
    )
    for prefix, struct in (
        ("report", VerifyReport),
        ("audit", PackingAudit),
        ("manifest", ShardManifest),
        ("special", SpecialTokens),
    ):
        for key in struct.__struct_fields__:
            assert any(n.startswith(f"{prefix}-{key.removesuffix('s')}") for n in MUTATIONS), key


# Cheap early checks


def test_out_holding_a_different_corpus_is_refused_before_the_build(
    tmp_path, fixture_corpus, tr_chat_inputs, tokenizer_json
):
    """The extra input's bad record would stop the build: the refusal must come first."""
    out = Path(shutil.copytree(fixture_corpus, tmp_path / "data"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [\n', encoding="utf-8")
    with pytest.raises(BuildError, match=r"holds a different corpus; .*\(inputs differ\)"):
        build_corpus([*tr_chat_inputs, bad], tokenizer_json, out, BuildOptions(seq_len=1024))
    with pytest.raises(BuildError, match=r"\(seq_len differ\)"):
        build_corpus([*tr_chat_inputs], tokenizer_json, out, BuildOptions(seq_len=512))


def test_an_oversized_line_is_refused_or_dropped_without_reading_it_whole(tmp_path, tokenizer_json):
    long_answer = "uzun " * 400  # ~2 KB, above the 1 KB limit below
    path = _write_chats(
        tmp_path / "chats.jsonl",
        [("user", "Merhaba"), ("assistant", "Selam!")],
        [("user", "Anlat"), ("assistant", long_answer)],
        [("user", "Soru"), ("assistant", "Cevap")],
    )
    small = BuildOptions(seq_len=1024, max_line_bytes=1024)
    with pytest.raises(InputError, match=r"chats\.jsonl:2: the line holds \d+ bytes, more than"):
        build_corpus([path], tokenizer_json, tmp_path / "out", small)
    drop = BuildOptions(
        seq_len=1024, max_line_bytes=1024, policy=RecordPolicy(invalid_records="drop")
    )
    report = build_corpus([path], tokenizer_json, tmp_path / "out", drop)
    assert (report.sources[0].kept, report.sources[0].dropped) == (2, {"line_too_long": 1})


def test_bounded_lines_holds_at_most_the_limit_of_a_line():
    class Reader(io.BytesIO):
        largest = 0

        def readline(self, size=-1):
            line = super().readline(size)
            Reader.largest = max(Reader.largest, len(line))
            return line

    data = b"a" * 100 + b"\n" + b"b" * (5 << 20) + b"\n" + b"c\n"
    lines = list(bounded_lines(Reader(data), 1000))
    assert [len(x) for x in lines[::2]] == [101, 2]
    assert (lines[1].size, lines[1].limit) == ((5 << 20) + 1, 1000)
    assert Reader.largest == 1 << 20  # the skipped line is read in 1 MiB pieces, never whole


# Reported, not silent: OpenAI weight and Alpaca history


def _parse(record):
    return parse_record(json.dumps(record).encode(), "chats.jsonl", 1, RecordPolicy())


def test_openai_weight_zero_makes_the_message_context():
    turns = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "weight": 0},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d", "weight": 1},
    ]
    conv = _parse({"messages": turns})
    assert [m.trainable for m in conv.messages] == [False, False, False, True]
    bad = _parse({"messages": [*turns[:3], {**turns[3], "weight": 0.5}]})
    assert bad.reason == "invalid_message" and "'weight' must be 0 or 1, not 0.5" in bad.message


def test_alpaca_history_becomes_the_earlier_turns():
    conv = _parse({"instruction": "c", "output": "d", "history": [["a", "b"]], "system": "s"})
    assert [(m.role, m.text, m.trainable) for m in conv.messages] == [
        (ROLE_SYSTEM, "s", False),
        (ROLE_USER, "a", False),
        (ROLE_ASSISTANT, "b", True),
        (ROLE_USER, "c", False),
        (ROLE_ASSISTANT, "d", True),
    ]
    bad = _parse({"instruction": "c", "output": "d", "history": ["a"]})
    assert bad.reason == "invalid_message" and "'history' must be a list" in bad.message


def test_a_corpus_from_before_the_split_hash_is_refused_with_what_to_do(corpus):
    _edit_json(corpus / MANIFEST, lambda d: d.pop("validation_sha256"))
    problems = _both_refuse(corpus, "missing required field `validation_sha256`")
    assert "prepare the corpus again" in problems[0], problems
