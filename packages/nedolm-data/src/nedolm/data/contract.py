"""The four contract files of a corpus: their typed documents, writing them, and the claims.

Each file is a ``msgspec.Struct`` here (SPECIAL_TOKENS.json is ``format.SpecialTokens``): the
builder writes these structs, the verifier recomputes them, and the trainer's gate decodes them.
The claims a document makes about itself and the shard files (schema, status, policies,
manifest entries, registries) are checked by the ``*_problems`` functions below and nowhere
else: the gate raises the first one, ``verify.check_corpus`` reports them all.

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
from typing import Annotated, Any, TypeVar

import msgspec

from nedolm.data.atomic import atomic_write_bytes
from nedolm.data.format import SHARDS_DIR, SPECIAL_TOKENS_FILE, SpecialTokens
from nedolm.data.hashing import file_sha256, hash_files
from nedolm.data.packing import PackingCounts
from nedolm.data.records import BASE_ROLES, MESSAGE_END_TOKEN, MESSAGE_START_TOKEN, ROLE_HEADERS
from nedolm.data.schema import (
    CONTINUATION_POLICY,
    PACKING_AUDIT_SCHEMA,
    PACKING_POLICY,
    SHARD_MANIFEST_SCHEMA,
    TARGET_POLICY,
    VERIFY_SCHEMA,
)

VERIFY_REPORT_FILE = "FINAL_BINARY_VERIFY_REPORT.json"
PACKING_AUDIT_FILE = "PACKING_POLICY_ADAPTIVE_AUDIT.json"
SHARD_MANIFEST_FILE = "SHARD_MANIFEST.json"
CONTRACT_FILES = (VERIFY_REPORT_FILE, SPECIAL_TOKENS_FILE, PACKING_AUDIT_FILE, SHARD_MANIFEST_FILE)

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


class ManifestEntry(msgspec.Struct, frozen=True):
    """One shard file as SHARD_MANIFEST.json lists it (``path`` relative to DATA_DIR)."""

    path: str
    sha256: str
    size: int


class SourceEntry(msgspec.Struct, frozen=True, omit_defaults=True):
    """One input file's accounting in the manifest:
    ``records == kept + left_out + sum(dropped)``; the corpus holds ``kept + repeated`` of its
    conversations. Fields at their defaults are not written, so a corpus built without a
    mixture or validation inputs has the manifest it had before they existed."""

    name: str
    sha256: str
    records: int
    kept: int  # distinct conversations in the corpus
    dropped: dict[str, int]
    # Reported, not claimed (None: the corpus was built before they were counted):
    unk_target_tokens: int | None = None  # <unk> ids inside the kept records' targets
    lost_characters: int | None = None  # content characters that encode → decode loses
    duplicate_conversations: int | None = None  # records laid out exactly like an earlier one
    # A mixture (``prepare --mix``): the source's weight, its usable conversations the draw
    # left out, and the extra copies it added (a conversation drawn 3 times: 1 kept + 2 repeated)
    weight: float | None = None
    left_out: int = 0
    repeated: int = 0
    validation_shard: int | None = None  # a --val-input: the shard holding its documents


class BuildProvenance(msgspec.Struct, frozen=True):
    """The manifest's ``build`` block: the inputs, the tokenizer output digests, the tokenizer."""

    sources: list[SourceEntry]
    content_sha256: list[str]  # per shard, the builder's digest of the tokenizer output
    tokenizer_sha256: str


class ShardManifest(msgspec.Struct, frozen=True):
    """SHARD_MANIFEST.json: every shard file's size and sha256, plus the build's provenance.

    ``validation_sha256`` covers the held-out shard ids, which the trainer never trains unless
    its config says ``validation.train_on_held_out``.
    """

    schema: str
    status: str
    algorithm: str
    file_count: int
    files: list[ManifestEntry]
    aggregate_sha256: str
    shard_count: int
    validation_shard_ids: list[int]
    validation_sha256: str
    build: BuildProvenance


class PackingAudit(PackingCounts, frozen=True, kw_only=True):
    """PACKING_POLICY_ADAPTIVE_AUDIT.json: the summed plan counts at the corpus's seq_len."""

    schema: str
    status: str
    seq_len: int
    read_span_tokens: int
    packing_policy: str
    target_policy: str
    continuation_policy: str
    valid_context_ratio: float
    assistant_target_ratio: float
    per_shard: list[dict[str, int]]  # shard_id + that shard's counts (only shard_id: unplanned)


class VerifyReport(msgspec.Struct, frozen=True, kw_only=True):
    """FINAL_BINARY_VERIFY_REPORT.json: what the verifier recomputed, one flag per check."""

    schema: str
    status: str
    shards: int
    documents: int
    messages: int
    messages_by_role: dict[str, int]
    trainable_messages: int
    tokens_including_eos: int
    max_token_id: int
    vocab_size: int
    eos_id: int
    pad_id: int
    message_start_id: int
    message_end_id: int
    special_tokens_sha256: str
    content_sha256: list[str]
    global_doc_keys_unique: bool
    content_tokens_exact_vs_source: bool
    offsets_lengths_exact: bool
    turkish_user_header_verified: bool
    assistant_only_trainable_contract_verified: bool
    header_schema_verified: bool
    structural_control_counts_verified: bool
    token_id_range_verified: bool
    packing_plan_verified: bool


def dump_json(obj: Any) -> bytes:
    """Deterministic JSON (sorted keys, fixed indent): same content, same bytes."""
    builtins = msgspec.to_builtins(obj)
    return (json.dumps(builtins, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def aggregate_sha256(entries: list[ManifestEntry] | list[dict[str, Any]]) -> str:
    """sha256 of the canonical JSON of the manifest entries (the seed's definition)."""
    canonical = json.dumps(msgspec.to_builtins(entries), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def validation_sha256(validation_ids: list[int]) -> str:
    """sha256 of the held-out shard ids (sorted, canonical JSON)."""
    return hashlib.sha256(json.dumps(sorted(validation_ids)).encode()).hexdigest()


def manifest_document(
    files: list[ManifestEntry], validation_ids: list[int], build: BuildProvenance
) -> ShardManifest:
    """The manifest of ``files`` (the verifier's hashes), with the build's provenance."""
    return ShardManifest(
        schema=SHARD_MANIFEST_SCHEMA,
        status="PASS",
        algorithm="sha256",
        file_count=len(files),
        files=list(files),
        aggregate_sha256=aggregate_sha256(files),
        shard_count=len(files) // 3,
        validation_shard_ids=list(validation_ids),
        validation_sha256=validation_sha256(validation_ids),
        build=build,
    )


def packing_audit_document(
    seq_len: int, shard_counts: list[PackingCounts | None], passed: bool
) -> PackingAudit:
    """The packing audit from each shard's plan counts (None: the shard could not be planned)."""
    total = sum((c for c in shard_counts if c is not None), PackingCounts())
    capacity = total.windows * (seq_len + 1)
    return PackingAudit(
        schema=PACKING_AUDIT_SCHEMA,
        status="PASS" if passed and None not in shard_counts else "FAIL",
        seq_len=seq_len,
        read_span_tokens=seq_len + 1,
        packing_policy=PACKING_POLICY,
        target_policy=TARGET_POLICY,
        continuation_policy=CONTINUATION_POLICY,
        **msgspec.structs.asdict(total),
        valid_context_ratio=total.valid_context_tokens / capacity if capacity else 0.0,
        assistant_target_ratio=total.assistant_target_tokens / capacity if capacity else 0.0,
        per_shard=[
            {"shard_id": i, **(msgspec.structs.asdict(c) if c is not None else {})}
            for i, c in enumerate(shard_counts)
        ],
    )


def write_contract(
    data_dir: Path, report: VerifyReport, audit: PackingAudit, manifest: ShardManifest
) -> None:
    """Write the verify report, the audit and the manifest (SPECIAL_TOKENS.json is an input)."""
    data_dir = Path(data_dir)
    for name, document in (
        (VERIFY_REPORT_FILE, report),
        (PACKING_AUDIT_FILE, audit),
        (SHARD_MANIFEST_FILE, manifest),
    ):
        atomic_write_bytes(data_dir / name, dump_json(document))


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


_Document = TypeVar("_Document", bound=msgspec.Struct)


def typed(path: Path, doc: dict[str, Any], kind: type[_Document]) -> _Document:
    """``doc`` (parsed from ``path``) as its contract struct; a missing or mistyped key is named."""
    try:
        return msgspec.convert(doc, kind)
    except msgspec.ValidationError as exc:
        hint = ""
        if str(exc).startswith("Object missing required field"):
            hint = " (written by an older nedolm-data? prepare the corpus again with this version)"
        raise DatasetContractError(f"{path}: {exc}{hint}") from exc


class _AuditedSeqLen(msgspec.Struct):
    seq_len: Annotated[int, msgspec.Meta(gt=0)]


def audited_seq_len(data_dir: Path) -> int:
    """The seq_len the corpus in ``data_dir`` was packed and audited at: its packing audit's.

    Only that key is read, so that commands describing a corpus (``inspect``, ``stats``) work on
    one whose audit lacks keys of newer versions; training checks the whole audit.

    Raises:
        DatasetContractError: naming the file, when it is unreadable or has no positive seq_len.
    """
    path = data_dir / PACKING_AUDIT_FILE
    try:
        return msgspec.json.decode(path.read_bytes(), type=_AuditedSeqLen).seq_len
    except (OSError, msgspec.DecodeError) as exc:
        raise DatasetContractError(f"{path} has no usable seq_len ({exc})") from exc


def audit_problems(audit: PackingAudit, seq_len: int) -> list[str]:
    """The audit's claims: PASS, this schema, this ``seq_len`` and the policies, no hard cut."""
    checks = [
        (audit.status == "PASS", "the adaptive packing audit is not PASS"),
        (
            audit.schema == PACKING_AUDIT_SCHEMA,
            f"unexpected adaptive packing schema: {audit.schema}",
        ),
        (
            audit.seq_len == seq_len,
            f"audited for seq_len={audit.seq_len} but training uses seq_len={seq_len}",
        ),
        (audit.read_span_tokens == seq_len + 1, "the read span is not seq_len + 1"),
        (
            audit.packing_policy == PACKING_POLICY,
            f"unexpected packing policy {audit.packing_policy!r}",
        ),
        (
            audit.target_policy == TARGET_POLICY,
            f"not the exact-once target policy: {audit.target_policy!r}",
        ),
        (
            audit.continuation_policy == CONTINUATION_POLICY,
            f"unexpected continuation policy {audit.continuation_policy!r}",
        ),
        (audit.hard_continuations == 0, "the plan contains unsafe hard continuations"),
    ]
    return [why for ok, why in checks if not ok]


def manifest_problems(manifest: ShardManifest) -> list[str]:
    """The manifest's claims about itself: PASS sha256, schema, counts, digest, validation ids."""
    files = manifest.files
    checks = [
        (
            manifest.status == "PASS" and manifest.algorithm == "sha256",
            "not a PASS sha256 manifest",
        ),
        (
            manifest.schema == SHARD_MANIFEST_SCHEMA,
            f"unexpected shard manifest schema: {manifest.schema}",
        ),
        (bool(files), "the manifest lists no files"),
        (
            manifest.file_count == len(files),
            f"file_count {manifest.file_count} differs from the {len(files)} listed files",
        ),
        (
            manifest.aggregate_sha256 == aggregate_sha256(files),
            "aggregate_sha256: the aggregate digest does not match the listed files",
        ),
        (
            manifest.shard_count == len(files) // 3,
            f"shard_count {manifest.shard_count} is not a third of the {len(files)} files",
        ),
        (
            all(0 <= i < manifest.shard_count for i in manifest.validation_shard_ids),
            f"validation_shard_ids {manifest.validation_shard_ids} are not shard ids "
            f"below {manifest.shard_count}",
        ),
        (
            manifest.validation_sha256 == validation_sha256(manifest.validation_shard_ids),
            "validation_sha256 does not match validation_shard_ids (the held-out split changed)",
        ),
        (
            set(validation_sources(manifest.build)) <= set(manifest.validation_shard_ids),
            f"a validation input's shard is not among validation_shard_ids"
            f" {manifest.validation_shard_ids}",
        ),
    ]
    return [why for ok, why in checks if not ok]


def validation_sources(build: BuildProvenance) -> dict[int, str]:
    """Shard id -> name of the validation input it holds (``prepare --val-input``); empty for
    a corpus whose validation shards were held out of the training inputs."""
    return {s.validation_shard: s.name for s in build.sources if s.validation_shard is not None}


def read_validation_sources(data_dir: Path) -> dict[int, str]:
    """``validation_sources`` of the corpus at ``data_dir`` (its SHARD_MANIFEST.json)."""
    path = Path(data_dir) / SHARD_MANIFEST_FILE
    return validation_sources(msgspec.json.decode(path.read_bytes(), type=ShardManifest).build)


def build_problems(build: BuildProvenance, shard_count: int, special: SpecialTokens) -> list[str]:
    """The build block's claims: each source's accounting adds up, one content digest per
    shard, and the tokenizer hash is the one SPECIAL_TOKENS.json records for the corpus's
    tokenizer copy (the verifier checks the copy against that record, and names the copy)."""
    problems = [
        f"build.sources {s.name}: records {s.records} != kept {s.kept} + left_out"
        f" {s.left_out} + dropped {sum(s.dropped.values())}"
        for s in build.sources
        if s.records != s.kept + s.left_out + sum(s.dropped.values())
    ]
    problems += [
        f"build.sources {s.name}: negative count in kept, left_out, repeated or dropped"
        for s in build.sources
        if min(s.kept, s.left_out, s.repeated, *s.dropped.values()) < 0
    ]
    problems += [
        f"build.sources {s.name}: validation_shard {s.validation_shard} is not a shard id"
        f" below {shard_count}"
        for s in build.sources
        if s.validation_shard is not None and not 0 <= s.validation_shard < shard_count
    ]
    if len(build.content_sha256) != shard_count:
        problems.append(
            f"build.content_sha256 holds {len(build.content_sha256)} digests for {shard_count} shards"
        )
    if build.tokenizer_sha256 != special.tokenizer.sha256:
        problems.append(
            f"build.tokenizer_sha256 differs from the sha256 of the tokenizer copy "
            f"{special.tokenizer.file} that {SPECIAL_TOKENS_FILE} records"
        )
    return problems


def listing_problems(listed: list[ManifestEntry], on_disk: list[str]) -> list[str]:
    """The manifest lists exactly the shard files on disk (paths relative to DATA_DIR)."""
    paths, disk = {e.path for e in listed}, set(on_disk)
    return [f"lists {p}, which is not on disk" for p in sorted(paths - disk)] + [
        f"does not list {p}, which is on disk" for p in sorted(disk - paths)
    ]


def entry_problems(listed: list[ManifestEntry], actual: list[ManifestEntry]) -> list[str]:
    """Each listed file that is on disk still has the size and sha256 the manifest records."""
    now = {e.path: e for e in actual}
    problems = []
    for want in listed:
        got = now.get(want.path)
        if got is not None and want.size != got.size:
            problems.append(f"size of {want.path} changed after verification")
        elif got is not None and want.sha256 != got.sha256:
            problems.append(f"sha256 of {want.path} changed after verification")
    return problems


def report_problems(report: VerifyReport, special: SpecialTokens, vocab_size: int) -> list[str]:
    """The report's claims the trainer relies on: this schema and vocabulary, the ids of
    SPECIAL_TOKENS.json, no id outside the vocabulary, and every required check true."""
    problems = []
    if report.schema != VERIFY_SCHEMA:
        problems.append(f"unexpected verify report schema: {report.schema}")
    if report.vocab_size != vocab_size:
        problems.append(f"corpus vocab_size={report.vocab_size} but model vocab={vocab_size}")
    problems += [
        f"{key}={getattr(report, key)} but {SPECIAL_TOKENS_FILE} says {getattr(special, key)}"
        for key in ("eos_id", "pad_id", "message_start_id", "message_end_id", "vocab_size")
        if getattr(report, key) != getattr(special, key)
    ]
    if report.max_token_id >= vocab_size:
        problems.append("the corpus holds a token id outside the model vocabulary")
    missing = [key for key in REQUIRED_TRUE if getattr(report, key) is not True]
    if missing:
        problems.append(f"verifier contract missing PASS fields: {missing}")
    return problems


def control_registry_problem(special: SpecialTokens) -> str | None:
    """The control tokens are exactly ``<|mesaj_basla|>`` and ``<|mesaj_bitir|>`` at their ids."""
    controls = {c.id: c.token for c in special.control_tokens}
    expected = {
        special.message_start_id: MESSAGE_START_TOKEN,
        special.message_end_id: MESSAGE_END_TOKEN,
    }
    if controls != expected:
        return f"unexpected control-token registry: {controls}, expected {expected}"
    return None


def role_registry_problem(special: SpecialTokens) -> str | None:
    """The role registry is the Turkish one of the SPEC: the base roles, plus the optional
    registry roles (``tool``) the corpus registered."""
    expected = {n: w for n, w in ROLE_HEADERS.items() if n in BASE_ROLES or n in special.roles}
    if special.roles != expected:
        return f"unexpected role registry: {special.roles}, expected {expected}"
    return None


def shard_files_on_disk(data_dir: Path) -> list[str]:
    """Every ``shards/*.{tokens,segments,index}.bin`` path relative to ``data_dir``, sorted."""
    return sorted(
        p.relative_to(data_dir).as_posix()
        for kind in ("tokens", "segments", "index")
        for p in (data_dir / SHARDS_DIR).glob(f"*.{kind}.bin")
    )


def hash_entries(data_dir: Path, paths: list[Path], workers: int = 8) -> list[ManifestEntry]:
    """Manifest entries of ``paths`` (hashed in parallel threads)."""
    return msgspec.convert(hash_files(data_dir, paths, workers), list[ManifestEntry])


def validate_dataset_contract(data_dir: Path, vocab_size: int, seq_len: int) -> dict[str, Any]:
    """Refuse a corpus that is not verified PASS for ``seq_len`` and this model vocabulary,
    or that ``verify`` would reject: the one gate, everything but a re-encode of the sources.

    Returns the corpus fingerprint (sha256 over the four contract files) and the per-epoch
    counts the trainer logs, compares with its own plan and stores in its checkpoints.

    Raises:
        DatasetContractError: naming the file and the failed requirement.
    """
    data_dir = Path(data_dir)
    docs = read_contract(data_dir)

    def refuse(name: str, problems: list[str]) -> None:
        if problems:
            raise DatasetContractError(f"{data_dir / name}: {problems[0]}")

    verify = typed(data_dir / VERIFY_REPORT_FILE, docs[VERIFY_REPORT_FILE], VerifyReport)
    special = typed(data_dir / SPECIAL_TOKENS_FILE, docs[SPECIAL_TOKENS_FILE], SpecialTokens)
    audit = typed(data_dir / PACKING_AUDIT_FILE, docs[PACKING_AUDIT_FILE], PackingAudit)
    manifest = typed(data_dir / SHARD_MANIFEST_FILE, docs[SHARD_MANIFEST_FILE], ShardManifest)

    refuse(
        VERIFY_REPORT_FILE,
        [] if verify.status == "PASS" else ["the final binary verifier is not PASS"],
    )
    refuse(PACKING_AUDIT_FILE, audit_problems(audit, seq_len))
    refuse(SHARD_MANIFEST_FILE, manifest_problems(manifest))
    refuse(VERIFY_REPORT_FILE, report_problems(verify, special, vocab_size))
    refuse(
        SPECIAL_TOKENS_FILE,
        [p for p in (control_registry_problem(special), role_registry_problem(special)) if p],
    )
    from nedolm.data.verify import check_corpus  # the verifier builds on this module

    problems = check_corpus(data_dir)
    if problems:
        raise DatasetContractError(
            f"{data_dir}: {problems[0]} (nedolm-sft verify lists all {len(problems)} problems)"
        )

    contract_bytes = [(data_dir / name).read_bytes() for name in CONTRACT_FILES]
    return {
        "fingerprint": hashlib.sha256(b"\0".join(contract_bytes)).hexdigest(),
        "verify_sha256": file_sha256(data_dir / VERIFY_REPORT_FILE),
        "special_tokens_sha256": file_sha256(data_dir / SPECIAL_TOKENS_FILE),
        "packing_policy_sha256": file_sha256(data_dir / PACKING_AUDIT_FILE),
        "shard_manifest_sha256": file_sha256(data_dir / SHARD_MANIFEST_FILE),
        "shard_manifest_files": len(manifest.files),
        "validation_shard_ids": list(manifest.validation_shard_ids),
        "training_windows": audit.windows,
        "assistant_target_tokens_per_epoch": audit.assistant_target_tokens,
        "valid_context_tokens_per_epoch": audit.valid_context_tokens,
        "padded_tokens_per_epoch": audit.padded_tokens,
        "turn_aligned_continuations": audit.turn_aligned_continuations,
        "assistant_aligned_continuations": audit.assistant_aligned_continuations,
        "documents": verify.documents,
        "messages": verify.messages,
        "tokens": verify.tokens_including_eos,
        "vocab_size": verify.vocab_size,
        "eos_id": verify.eos_id,
        "pad_id": verify.pad_id,
        "message_start_id": verify.message_start_id,
        "message_end_id": verify.message_end_id,
    }
