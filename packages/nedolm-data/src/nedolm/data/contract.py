"""The four contract files of a corpus: their content, writing them, and the trainer's gate.

``validate_dataset_contract`` is what the trainer runs (on rank 0) before touching a corpus. It
keeps the seed's semantics: every schema string, status and ``*_verified`` key must be as the
verifier writes them, the manifest must list exactly the shard files on disk with their size and
sha256 (re-hashed here, in parallel) and its aggregate digest must match, and the corpus must
have been verified for this ``seq_len`` and this model vocabulary. Each refusal says why.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgspec

from nedolm.data.atomic import atomic_write_bytes
from nedolm.data.format import SHARDS_DIR, SPECIAL_TOKENS_FILE
from nedolm.data.hashing import file_sha256, hash_files
from nedolm.data.packing import PackingCounts
from nedolm.data.records import (
    CONTINUATION_POLICY,
    MESSAGE_END_TOKEN,
    MESSAGE_START_TOKEN,
    PACKING_AUDIT_SCHEMA,
    PACKING_POLICY,
    ROLE_HEADERS,
    SHARD_MANIFEST_SCHEMA,
    TARGET_POLICY,
)

VERIFY_REPORT_FILE = "FINAL_BINARY_VERIFY_REPORT.json"
PACKING_AUDIT_FILE = "PACKING_POLICY_ADAPTIVE_AUDIT.json"
SHARD_MANIFEST_FILE = "SHARD_MANIFEST.json"
CONTRACT_FILES = (VERIFY_REPORT_FILE, SPECIAL_TOKENS_FILE, PACKING_AUDIT_FILE, SHARD_MANIFEST_FILE)

VERIFY_SCHEMA = "nedolm_sft_final_binary_verify_v1"
REQUIRED_TRUE = (
    "global_doc_keys_unique",
    "content_tokens_exact_vs_source",
    "offsets_lengths_exact",
    "turkish_user_header_verified",
    "assistant_only_trainable_contract_verified",
    "header_schema_verified",
    "structural_control_counts_verified",
    "token_id_range_verified",
)
"""Verifier keys the trainer requires to be true (the seed's contract)."""


class DatasetContractError(RuntimeError):
    """A corpus the trainer must not use; the message says which file and what."""


def dump_json(obj: Any) -> bytes:
    """Deterministic JSON (sorted keys, fixed indent): same content, same bytes."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def write_json(path: Path, obj: Any) -> None:
    """Deterministic JSON written atomically."""
    atomic_write_bytes(path, dump_json(obj))


def aggregate_sha256(entries: list[dict[str, Any]]) -> str:
    """sha256 of the canonical JSON of the manifest entries (the seed's definition)."""
    canonical = json.dumps(entries, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def manifest_document(
    files: list[dict[str, Any]], validation_ids: list[int], build: dict[str, Any]
) -> dict[str, Any]:
    """SHARD_MANIFEST.json: every shard file's size and sha256, plus the build's provenance."""
    return {
        "schema": SHARD_MANIFEST_SCHEMA,
        "status": "PASS",
        "algorithm": "sha256",
        "file_count": len(files),
        "files": files,
        "aggregate_sha256": aggregate_sha256(files),
        "shard_count": len(files) // 3,
        "validation_shard_ids": validation_ids,
        "build": build,
    }


def packing_audit_document(
    seq_len: int, shard_counts: list[PackingCounts | None], passed: bool
) -> dict[str, Any]:
    """PACKING_POLICY_ADAPTIVE_AUDIT.json from each shard's plan counts (None: not planned)."""
    total = sum((c for c in shard_counts if c is not None), PackingCounts())
    capacity = total.windows * (seq_len + 1)
    return {
        "schema": PACKING_AUDIT_SCHEMA,
        "status": "PASS" if passed and None not in shard_counts else "FAIL",
        "seq_len": seq_len,
        "read_span_tokens": seq_len + 1,
        "packing_policy": PACKING_POLICY,
        "target_policy": TARGET_POLICY,
        "continuation_policy": CONTINUATION_POLICY,
        **msgspec.to_builtins(total),
        "valid_context_ratio": total.valid_context_tokens / capacity if capacity else 0.0,
        "assistant_target_ratio": total.assistant_target_tokens / capacity if capacity else 0.0,
        "per_shard": [
            {"shard_id": i, **(msgspec.to_builtins(c) if c is not None else {})}
            for i, c in enumerate(shard_counts)
        ],
    }


def write_contract(
    data_dir: Path, report: dict[str, Any], audit: dict[str, Any], manifest: dict[str, Any]
) -> None:
    """Write the verify report, the audit and the manifest (SPECIAL_TOKENS.json is an input)."""
    data_dir = Path(data_dir)
    write_json(data_dir / VERIFY_REPORT_FILE, report)
    write_json(data_dir / PACKING_AUDIT_FILE, audit)
    write_json(data_dir / SHARD_MANIFEST_FILE, manifest)


def read_contract(data_dir: Path) -> dict[str, dict[str, Any]]:
    """The four contract files parsed, by file name; a missing or unparsable one is named."""
    data_dir = Path(data_dir)
    missing = [name for name in CONTRACT_FILES if not (data_dir / name).is_file()]
    if missing:
        raise DatasetContractError(f"{data_dir}: verified SFT contract missing: {missing}")
    docs = {}
    for name in CONTRACT_FILES:
        try:
            doc = json.loads((data_dir / name).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DatasetContractError(f"{data_dir / name}: not valid JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise DatasetContractError(f"{data_dir / name}: not a JSON object")
        docs[name] = doc
    return docs


def _int(doc: dict[str, Any], key: str, default: int = -1) -> int:
    try:
        return int(doc.get(key, default))
    except (TypeError, ValueError):
        return default


def validate_dataset_contract(data_dir: Path, vocab_size: int, seq_len: int) -> dict[str, Any]:
    """Refuse a corpus that is not verified PASS for ``seq_len`` and this model vocabulary.

    Returns the corpus fingerprint (sha256 over the four contract files) and the per-epoch
    counts the trainer logs and compares with its own plan.

    Raises:
        DatasetContractError: naming the file and the failed requirement.
    """
    data_dir = Path(data_dir)
    docs = read_contract(data_dir)
    verify = docs[VERIFY_REPORT_FILE]
    special = docs[SPECIAL_TOKENS_FILE]
    packing = docs[PACKING_AUDIT_FILE]
    manifest = docs[SHARD_MANIFEST_FILE]

    def refuse(name: str, why: str) -> DatasetContractError:
        return DatasetContractError(f"{data_dir / name}: {why}")

    if verify.get("status") != "PASS":
        raise refuse(VERIFY_REPORT_FILE, "the final binary verifier is not PASS")
    _check_packing(packing, seq_len, lambda why: refuse(PACKING_AUDIT_FILE, why))
    entries = _check_manifest(manifest, lambda why: refuse(SHARD_MANIFEST_FILE, why))

    on_disk = sorted(
        p.relative_to(data_dir).as_posix()
        for kind in ("tokens", "segments", "index")
        for p in (data_dir / SHARDS_DIR).glob(f"*.{kind}.bin")
    )
    listed = sorted(str(item.get("path", "")) for item in entries)
    if listed != on_disk:
        extra, absent = sorted(set(on_disk) - set(listed)), sorted(set(listed) - set(on_disk))
        raise refuse(
            SHARD_MANIFEST_FILE,
            f"listed shard files differ from those on disk: not listed {extra}, missing {absent}",
        )
    actual = hash_files(data_dir, [data_dir / p for p in listed])
    expected = {str(item["path"]): item for item in entries}
    for entry in actual:
        want = expected[entry["path"]]
        if int(want.get("size", -1)) != entry["size"]:
            raise refuse(SHARD_MANIFEST_FILE, f"size of {entry['path']} changed after verification")
        if str(want.get("sha256")) != entry["sha256"]:
            raise refuse(
                SHARD_MANIFEST_FILE, f"sha256 of {entry['path']} changed after verification"
            )

    if _int(verify, "vocab_size") != vocab_size:
        raise refuse(
            VERIFY_REPORT_FILE,
            f"corpus vocab_size={verify.get('vocab_size')} but model vocab={vocab_size}",
        )
    for key in ("eos_id", "pad_id", "message_start_id", "message_end_id", "vocab_size"):
        if _int(verify, key) != _int(special, key, -2):
            raise refuse(
                VERIFY_REPORT_FILE,
                f"{key}={verify.get(key)} but {SPECIAL_TOKENS_FILE} says {special.get(key)}",
            )
    if _int(verify, "max_token_id", vocab_size) >= vocab_size:
        raise refuse(VERIFY_REPORT_FILE, "the corpus holds a token id outside the model vocabulary")
    missing = [key for key in REQUIRED_TRUE if verify.get(key) is not True]
    if missing:
        raise refuse(VERIFY_REPORT_FILE, f"verifier contract missing PASS fields: {missing}")

    controls = {
        _int(c, "id"): c.get("token")
        for c in special.get("control_tokens", [])
        if isinstance(c, dict)
    }
    expected_controls = {
        _int(verify, "message_start_id"): MESSAGE_START_TOKEN,
        _int(verify, "message_end_id"): MESSAGE_END_TOKEN,
    }
    if controls != expected_controls:
        raise refuse(SPECIAL_TOKENS_FILE, f"unexpected control-token registry: {controls}")
    if special.get("roles") != ROLE_HEADERS:
        raise refuse(SPECIAL_TOKENS_FILE, f"unexpected role registry: {special.get('roles')}")

    contract_bytes = [(data_dir / name).read_bytes() for name in CONTRACT_FILES]
    return {
        "fingerprint": hashlib.sha256(b"\0".join(contract_bytes)).hexdigest(),
        "verify_sha256": file_sha256(data_dir / VERIFY_REPORT_FILE),
        "special_tokens_sha256": file_sha256(data_dir / SPECIAL_TOKENS_FILE),
        "packing_policy_sha256": file_sha256(data_dir / PACKING_AUDIT_FILE),
        "shard_manifest_sha256": file_sha256(data_dir / SHARD_MANIFEST_FILE),
        "shard_manifest_files": len(entries),
        "validation_shard_ids": list(manifest.get("validation_shard_ids", [])),
        "training_windows": int(packing["windows"]),
        "assistant_target_tokens_per_epoch": int(packing["assistant_target_tokens"]),
        "valid_context_tokens_per_epoch": int(packing["valid_context_tokens"]),
        "padded_tokens_per_epoch": int(packing["padded_tokens"]),
        "turn_aligned_continuations": int(packing["turn_aligned_continuations"]),
        "assistant_aligned_continuations": int(packing["assistant_aligned_continuations"]),
        "documents": int(verify["documents"]),
        "messages": int(verify["messages"]),
        "tokens": int(verify["tokens_including_eos"]),
        "vocab_size": int(verify["vocab_size"]),
        "eos_id": int(verify["eos_id"]),
        "pad_id": int(verify["pad_id"]),
        "message_start_id": int(verify["message_start_id"]),
        "message_end_id": int(verify["message_end_id"]),
    }


def _check_packing(packing: dict[str, Any], seq_len: int, refuse: Any) -> None:
    if packing.get("status") != "PASS":
        raise refuse("the adaptive packing audit is not PASS")
    if packing.get("schema") != PACKING_AUDIT_SCHEMA:
        raise refuse(f"unexpected adaptive packing schema: {packing.get('schema')}")
    if _int(packing, "seq_len") != seq_len:
        raise refuse(
            f"audited for seq_len={packing.get('seq_len')} but training uses seq_len={seq_len}"
        )
    if _int(packing, "read_span_tokens") != seq_len + 1:
        raise refuse("the read span is not seq_len + 1")
    if packing.get("packing_policy") != PACKING_POLICY:
        raise refuse(f"unexpected packing policy {packing.get('packing_policy')!r}")
    if packing.get("target_policy") != TARGET_POLICY:
        raise refuse(f"not the exact-once target policy: {packing.get('target_policy')!r}")
    if packing.get("continuation_policy") != CONTINUATION_POLICY:
        raise refuse(f"unexpected continuation policy {packing.get('continuation_policy')!r}")
    if _int(packing, "hard_continuations") != 0:
        raise refuse("the plan contains unsafe hard continuations")


def _check_manifest(manifest: dict[str, Any], refuse: Any) -> list[dict[str, Any]]:
    if manifest.get("status") != "PASS" or manifest.get("algorithm") != "sha256":
        raise refuse("not a PASS sha256 manifest")
    if manifest.get("schema") != SHARD_MANIFEST_SCHEMA:
        raise refuse(f"unexpected shard manifest schema: {manifest.get('schema')}")
    entries = manifest.get("files")
    if (
        not isinstance(entries, list)
        or not entries
        or not all(isinstance(e, dict) for e in entries)
    ):
        raise refuse("the manifest lists no files")
    if _int(manifest, "file_count") != len(entries):
        raise refuse("file_count differs from the number of listed files")
    if aggregate_sha256(entries) != str(manifest.get("aggregate_sha256", "")):
        raise refuse("the aggregate digest does not match the listed files")
    return entries
