"""``validate_dataset_contract``: the trainer's gate keeps every refusal of the seed."""

from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest

from nedolm.data.contract import (
    CONTRACT_FILES,
    REQUIRED_TRUE,
    DatasetContractError,
    aggregate_sha256,
    audited_seq_len,
    validate_dataset_contract,
)
from nedolm.data.packing import discover_sft_shards
from nedolm.data.roles import validate_roles
from nedolm.data.summary import corpus_summary
from nedolm.data.verify import check_corpus

VOCAB, SEQ_LEN = 32003, 1024


def _edit(path, edit):
    doc = json.loads(path.read_text(encoding="utf-8"))
    edit(doc)
    path.write_text(json.dumps(doc), encoding="utf-8")


def test_gate_returns_the_seed_fingerprint_and_counts(corpus):
    gate = validate_dataset_contract(corpus, VOCAB, SEQ_LEN)
    # fingerprint = sha256 over the four files joined by NUL, in the seed's order
    joined = b"\0".join((corpus / name).read_bytes() for name in CONTRACT_FILES)
    assert gate["fingerprint"] == hashlib.sha256(joined).hexdigest()
    audit = json.loads((corpus / "PACKING_POLICY_ADAPTIVE_AUDIT.json").read_text(encoding="utf-8"))
    assert gate["training_windows"] == audit["windows"]
    assert gate["assistant_target_tokens_per_epoch"] == audit["assistant_target_tokens"]
    assert gate["shard_manifest_files"] == 6


def test_manifest_aggregate_is_the_seed_canonical_json(corpus):
    manifest = json.loads((corpus / "SHARD_MANIFEST.json").read_text(encoding="utf-8"))
    canonical = json.dumps(manifest["files"], sort_keys=True, separators=(",", ":")).encode()
    assert manifest["aggregate_sha256"] == hashlib.sha256(canonical).hexdigest()


@pytest.mark.parametrize(
    ("file_name", "edit", "message"),
    [
        (
            "FINAL_BINARY_VERIFY_REPORT.json",
            lambda d: d.update(status="FAIL"),
            "verifier is not PASS",
        ),
        (
            "PACKING_POLICY_ADAPTIVE_AUDIT.json",
            lambda d: d.update(status="FAIL"),
            "audit is not PASS",
        ),
        (
            "PACKING_POLICY_ADAPTIVE_AUDIT.json",
            lambda d: d.update(schema="v1"),
            "unexpected adaptive packing schema",
        ),
        (
            "PACKING_POLICY_ADAPTIVE_AUDIT.json",
            lambda d: d.update(read_span_tokens=1024),
            "read span",
        ),
        (
            "PACKING_POLICY_ADAPTIVE_AUDIT.json",
            lambda d: d.update(packing_policy="greedy"),
            "packing policy",
        ),
        (
            "PACKING_POLICY_ADAPTIVE_AUDIT.json",
            lambda d: d.update(target_policy="all"),
            "exact-once",
        ),
        (
            "PACKING_POLICY_ADAPTIVE_AUDIT.json",
            lambda d: d.update(continuation_policy="x"),
            "continuation policy",
        ),
        (
            "PACKING_POLICY_ADAPTIVE_AUDIT.json",
            lambda d: d.update(hard_continuations=2),
            "hard continuations",
        ),
        ("SHARD_MANIFEST.json", lambda d: d.update(algorithm="md5"), "not a PASS sha256 manifest"),
        ("SHARD_MANIFEST.json", lambda d: d.update(schema="x"), "unexpected shard manifest schema"),
        ("SHARD_MANIFEST.json", lambda d: d.update(files=[]), "lists no files"),
        ("SHARD_MANIFEST.json", lambda d: d.update(file_count=5), "file_count"),
        ("SHARD_MANIFEST.json", lambda d: d.update(aggregate_sha256="0" * 64), "aggregate digest"),
        (
            "FINAL_BINARY_VERIFY_REPORT.json",
            lambda d: d.update(max_token_id=VOCAB),
            "outside the model vocabulary",
        ),
        (
            "FINAL_BINARY_VERIFY_REPORT.json",
            lambda d: d.update(eos_id=1),
            "eos_id=1 but SPECIAL_TOKENS.json says 2",
        ),
        ("SPECIAL_TOKENS.json", lambda d: d.update(control_tokens=[]), "control-token registry"),
        ("SPECIAL_TOKENS.json", lambda d: d.update(roles={"user": "user"}), "role registry"),
    ],
)
def test_each_refusal_names_the_file(corpus, file_name, edit, message):
    _edit(corpus / file_name, edit)
    with pytest.raises(DatasetContractError, match=message) as err:
        validate_dataset_contract(corpus, VOCAB, SEQ_LEN)
    assert file_name in str(err.value)


@pytest.mark.parametrize("key", REQUIRED_TRUE)
def test_every_required_verifier_key_must_be_true(corpus, key):
    _edit(corpus / "FINAL_BINARY_VERIFY_REPORT.json", lambda d: d.update({key: False}))
    with pytest.raises(DatasetContractError, match=f"missing PASS fields: \\['{key}'\\]"):
        validate_dataset_contract(corpus, VOCAB, SEQ_LEN)


def test_wrong_seq_len_or_vocab(corpus):
    with pytest.raises(
        DatasetContractError, match="audited for seq_len=1024 but training uses seq_len=2048"
    ):
        validate_dataset_contract(corpus, VOCAB, 2048)
    with pytest.raises(DatasetContractError, match="corpus vocab_size=32003 but model vocab=32064"):
        validate_dataset_contract(corpus, 32064, SEQ_LEN)


@pytest.mark.parametrize("file_name", CONTRACT_FILES)
def test_missing_contract_file(corpus, file_name):
    (corpus / file_name).unlink()
    with pytest.raises(DatasetContractError, match=f"contract missing: \\['{file_name}'\\]"):
        validate_dataset_contract(corpus, VOCAB, SEQ_LEN)


def test_changed_shard_bytes_or_size(corpus):
    path = corpus / "shards" / "sft-00001-of-00002.segments.bin"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(
        DatasetContractError, match=r"sha256 of shards/sft-00001-of-00002\.segments\.bin changed"
    ):
        validate_dataset_contract(corpus, VOCAB, SEQ_LEN)
    path.write_bytes(bytes(data) + b"\0")
    with pytest.raises(
        DatasetContractError, match=r"size of shards/sft-00001-of-00002\.segments\.bin changed"
    ):
        validate_dataset_contract(corpus, VOCAB, SEQ_LEN)


def test_shard_file_set_must_match_the_manifest(corpus):
    shutil.copy(
        corpus / "shards" / "sft-00000-of-00002.index.bin",
        corpus / "shards" / "sft-00009-of-00002.index.bin",
    )
    with pytest.raises(
        DatasetContractError,
        match=r"does not list shards/sft-00009-of-00002\.index\.bin, which is on disk",
    ):
        validate_dataset_contract(corpus, VOCAB, SEQ_LEN)


def test_garbled_json_is_named(corpus):
    (corpus / "SPECIAL_TOKENS.json").write_text("{", encoding="utf-8")
    with pytest.raises(DatasetContractError, match=r"SPECIAL_TOKENS\.json: not valid JSON"):
        validate_dataset_contract(corpus, VOCAB, SEQ_LEN)


def test_aggregate_helper_matches_manual_canonical_form():
    entries = [
        {"path": "shards/b", "size": 2, "sha256": "y"},
        {"sha256": "x", "path": "shards/a", "size": 1},
    ]
    manual = '[{"path":"shards/b","sha256":"y","size":2},{"path":"shards/a","sha256":"x","size":1}]'
    assert aggregate_sha256(entries) == hashlib.sha256(manual.encode()).hexdigest()


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(validation_shard_ids=[7]),
        lambda d: d.update(shard_count=3),
        lambda d: d["files"][0].update(sha256="0" * 64),
    ],
)
def test_gate_and_verifier_report_a_manifest_claim_in_the_same_words(corpus, edit):
    """One owner per claim: the gate raises the line check_corpus reports for the same edit."""
    _edit(corpus / "SHARD_MANIFEST.json", edit)
    with pytest.raises(DatasetContractError) as err:
        validate_dataset_contract(corpus, VOCAB, SEQ_LEN)
    gate_line = str(err.value).split("SHARD_MANIFEST.json: ", 1)[1]
    assert f"SHARD_MANIFEST.json: {gate_line}" in check_corpus(corpus)


def test_role_counts_agree_across_verifier_summary_and_trainer_check(corpus):
    report = json.loads((corpus / "FINAL_BINARY_VERIFY_REPORT.json").read_text(encoding="utf-8"))
    summary = corpus_summary(corpus)
    trainer = validate_roles(discover_sft_shards(corpus, SEQ_LEN))
    assert report["messages_by_role"] == summary["messages_by_role"]
    assert report["messages_by_role"] == {n: trainer[n] for n in ("system", "user", "assistant")}
    assert report["trainable_messages"] == trainer["assistant_trainable"]
    assert summary["assistant_trainable_messages"] == trainer["assistant_trainable"]
    assert summary["assistant_context_messages"] == trainer["assistant_context"]


def test_audited_seq_len_reads_only_that_key_and_names_the_file_it_cannot_use(corpus):
    audit = corpus / "PACKING_POLICY_ADAPTIVE_AUDIT.json"
    assert audited_seq_len(corpus) == SEQ_LEN
    _edit(audit, lambda doc: doc.pop("schema"))  # an older audit: still describes its corpus
    assert audited_seq_len(corpus) == SEQ_LEN
    for bad in (0, "1024", None):
        _edit(audit, lambda doc, bad=bad: doc.update(seq_len=bad))
        with pytest.raises(
            DatasetContractError, match=f"{re.escape(str(audit))} has no usable seq_len"
        ):
            audited_seq_len(corpus)
    audit.write_text("{", encoding="utf-8")
    with pytest.raises(DatasetContractError, match="has no usable seq_len"):
        audited_seq_len(corpus)
    audit.unlink()
    with pytest.raises(
        DatasetContractError, match=f"{re.escape(str(audit))} has no usable seq_len"
    ):
        audited_seq_len(corpus)
