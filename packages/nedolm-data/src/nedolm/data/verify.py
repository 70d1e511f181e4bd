"""The verifier: recompute every claim of the contract files from the binaries.

``verify_corpus`` reads only SPECIAL_TOKENS.json (the definition of the ids), the tokenizer copy
and the shard files, and recomputes the FINAL_BINARY_VERIFY_REPORT, the packing audit and the
manifest's file entries. Each ``*_verified`` key is True only if its check ran and passed; every
failed check adds a problem that names the shard file or contract file. ``check_corpus`` then
compares the recomputation with the contract files on disk, so an edited, truncated, flipped or
deleted file is reported by name.

``content_tokens_exact_vs_source`` compares, per shard, a digest of every message's content
tokens read back from the binaries with the digest the builder took from the tokenizer's output
before laying the documents out (kept in SHARD_MANIFEST.json). A later ``verify`` without the
sources can therefore still prove that the binaries hold exactly what the tokenizer produced.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from nedolm.data.contract import (
    PACKING_AUDIT_FILE,
    REQUIRED_TRUE,
    SHARD_MANIFEST_FILE,
    VERIFY_REPORT_FILE,
    DatasetContractError,
    ManifestEntry,
    PackingAudit,
    ShardManifest,
    VerifyReport,
    build_problems,
    control_registry_problem,
    entry_problems,
    hash_entries,
    listing_problems,
    manifest_problems,
    packing_audit_document,
    read_contract,
    role_registry_problem,
    shard_files_on_disk,
    typed,
)
from nedolm.data.format import (
    SPECIAL_TOKENS_FILE,
    Shard,
    ShardFormatError,
    SpecialTokens,
    discover_shards,
    read_array,
    read_special_tokens,
)
from nedolm.data.hashing import ContentDigest, file_sha256
from nedolm.data.packing import PackingCounts, PackingError, plan_shard
from nedolm.data.records import MESSAGE_END_TOKEN, MESSAGE_START_TOKEN, ROLE_NAMES
from nedolm.data.roles import RoleAudit, audit_roles, role_totals
from nedolm.data.schema import VERIFY_SCHEMA
from nedolm.data.tokenizer import (
    TextTokenizer,
    TokenizerError,
    content_forbidden_ids,
    load_tokenizer,
)


@dataclass
class ShardFacts:
    """What one shard's binaries say, and what is wrong with them."""

    documents: int = 0
    messages: int = 0
    tokens: int = 0
    max_token_id: int = -1
    roles: RoleAudit | None = None
    doc_keys: np.ndarray = field(default_factory=lambda: np.empty(0, "<u8"))
    content_sha256: str = ""
    counts: PackingCounts | None = None
    failed: dict[str, list[str]] = field(default_factory=dict)  # check key -> problems
    readable: bool = True  # False: a file could not be read, the other facts are empty

    def fail(self, check: str, problem: str) -> None:
        self.failed.setdefault(check, []).append(problem)


def check_shard(
    shard: Shard, specials: SpecialTokens, seq_len: int, forbidden: set[int]
) -> ShardFacts:
    """Recompute one shard's facts from its three files (vectorised, no per-token Python).

    Every problem names the one of the three files at fault; ``forbidden`` holds the ids that
    must not occur inside content (the tokenizer's special ids and the corpus's).
    """
    facts = ShardFacts()
    t_name, s_name = shard.token_path.name, shard.segments_path.name
    try:  # local maps, released on return: memory stays one shard whatever the corpus size
        tokens = read_array(shard.token_path, "tokens")
        segments = read_array(shard.segments_path, "segments")
        index = read_array(shard.index_path, "index")
    except ShardFormatError as exc:
        facts.fail("offsets_lengths_exact", str(exc))
        facts.readable = False
        return facts
    facts.documents, facts.messages, facts.tokens = len(index), len(segments), len(tokens)
    facts.doc_keys = np.array(index["doc_key"])
    if len(tokens):
        facts.max_token_id = int(tokens.max())
    layout, at_fault = _check_offsets(shard, tokens, segments, index, facts)
    _check_token_range(t_name, tokens, specials, facts)
    _check_roles_and_targets(s_name, segments, facts)
    if layout is None:
        for check in (
            "structural_control_counts_verified",
            "header_schema_verified",
            "content_tokens_exact_vs_source",
        ):
            facts.fail(check, f"{at_fault}: not checked, the offsets are broken")
        return facts
    _check_every_document_has_a_target(s_name, segments, index, facts)
    _check_controls(t_name, tokens, segments, index, layout, specials, facts)
    _check_headers(shard, tokens, segments, layout, specials, facts)
    positions, lengths = _content_positions(segments, layout)
    _check_no_special_in_content(t_name, tokens[positions], forbidden, facts)
    facts.content_sha256 = _content_digest(lengths, tokens[positions])
    try:
        facts.counts = plan_shard(index, segments, seq_len).counts
    except PackingError as exc:
        facts.fail("packing_plan_verified", f"{s_name}: the planner refuses the shard: {exc}")
    return facts


def _check_offsets(
    shard: Shard, tokens: np.ndarray, segments: np.ndarray, index: np.ndarray, facts: ShardFacts
) -> tuple[np.ndarray | None, str]:
    """Index and segment offsets contiguous and exact: the absolute message starts (None when
    broken) and the file at fault."""
    key = "offsets_lengths_exact"
    t_name, s_name, name = (p.name for p in shard.paths)
    token_len = index["token_len"].astype(np.int64)
    seg_count = index["segment_count"].astype(np.int64)
    expected_start = np.cumsum(token_len) - token_len
    expected_seg = np.cumsum(seg_count) - seg_count
    bad = []
    if int(token_len.sum()) != len(tokens):
        bad.append(f"documents hold {int(token_len.sum())} tokens, {t_name} {len(tokens)}")
    if int(seg_count.sum()) != len(segments):
        bad.append(f"documents hold {int(seg_count.sum())} messages, {s_name} {len(segments)}")
    for field_name, expected in (("token_start", expected_start), ("segment_start", expected_seg)):
        wrong = index[field_name].astype(np.int64) != expected
        if wrong.any():
            bad.append(f"{field_name} not contiguous (first bad document {_first(wrong)})")
    if (seg_count == 0).any():
        bad.append(f"document {_first(seg_count == 0)} has no message")
    if bad:
        for problem in bad:
            facts.fail(key, f"{name}: {problem}")
        return None, name
    name = s_name  # the index is consistent: what follows is the segments' fault
    length = segments["length"].astype(np.int64)
    header_len = segments["header_len"].astype(np.int64)
    ends = np.cumsum(length)
    within = (ends - length) - np.repeat((ends - length)[expected_seg], seg_count)
    wrong = segments["start"].astype(np.int64) != within
    if wrong.any():
        doc = int(np.searchsorted(np.cumsum(seg_count), _first(wrong), side="right"))
        facts.fail(key, f"{name}: messages not contiguous in document {doc}")
        return None, name
    last = expected_seg + seg_count - 1
    doc_end = within[last] + length[last]
    if not np.array_equal(doc_end + 1, token_len):
        facts.fail(
            key, f"{name}: messages + EOS do not fill document {_first(doc_end + 1 != token_len)}"
        )
        return None, name
    too_short = (header_len < 1) | (length < header_len + 1)
    if too_short.any():
        facts.fail(key, f"{name}: message {_first(too_short)} is shorter than header + end token")
        return None, name
    return np.repeat(expected_start, seg_count) + within, name


def _check_token_range(
    name: str, tokens: np.ndarray, specials: SpecialTokens, facts: ShardFacts
) -> None:
    if facts.max_token_id >= specials.vocab_size:
        facts.fail(
            "token_id_range_verified",
            f"{name}: token id {facts.max_token_id} >= vocab_size {specials.vocab_size}",
        )
    pads = int(np.count_nonzero(tokens == specials.pad_id))
    if pads:
        facts.fail(
            "token_id_range_verified",
            f"{name}: the pad id {specials.pad_id} occurs {pads} times inside documents",
        )


_CHECK_ORDER = [
    "offsets_lengths_exact",
    "header_schema_verified",
    "structural_control_counts_verified",
    "assistant_only_trainable_contract_verified",
    "token_id_range_verified",
    "turkish_user_header_verified",
    "global_doc_keys_unique",
    "packing_plan_verified",
    "content_tokens_exact_vs_source",
]
"""Problems are listed cause first: a broken layout before what it breaks downstream (the
content digest, which any layout fault changes too, comes last)."""

_ROLE_RULE_CHECKS = {
    "unknown_role": "header_schema_verified",
    "bad_flag": "assistant_only_trainable_contract_verified",
    "trainable_non_assistant": "assistant_only_trainable_contract_verified",
}
"""The verifier check each broken rule of the role audit fails."""


def _check_roles_and_targets(name: str, segments: np.ndarray, facts: ShardFacts) -> None:
    facts.roles = audit_roles(segments)
    for rule, problem in facts.roles.violations(segments, name).items():
        facts.fail(_ROLE_RULE_CHECKS[rule], problem)


def _check_every_document_has_a_target(
    name: str, segments: np.ndarray, index: np.ndarray, facts: ShardFacts
) -> None:
    """Builders drop documents without targets; one here would be a window of pure context."""
    seg_count = index["segment_count"].astype(np.int64)
    per_doc = np.add.reduceat(
        segments["trainable"].astype(np.int64), np.cumsum(seg_count) - seg_count
    )
    if (per_doc == 0).any():
        facts.fail(
            "assistant_only_trainable_contract_verified",
            f"{name}: document {_first(per_doc == 0)} has no trainable message",
        )


def _check_controls(
    name: str,
    tokens: np.ndarray,
    segments: np.ndarray,
    index: np.ndarray,
    starts: np.ndarray,
    specials: SpecialTokens,
    facts: ShardFacts,
) -> None:
    """Control tokens and EOS exactly where the layout puts them, and nowhere else."""
    key = "structural_control_counts_verified"
    ends = starts + segments["length"].astype(np.int64) - 1
    doc_ends = index["token_start"].astype(np.int64) + index["token_len"].astype(np.int64) - 1
    for what, positions, token_id in (
        (MESSAGE_START_TOKEN, starts, specials.message_start_id),
        (MESSAGE_END_TOKEN, ends, specials.message_end_id),
        ("EOS", doc_ends, specials.eos_id),
    ):
        wrong = tokens[positions] != token_id
        if wrong.any():
            first = int(positions[_first(wrong)])
            facts.fail(key, f"{name}: {int(wrong.sum())} {what} missing (first at token {first})")
        count = int(np.count_nonzero(tokens == token_id))
        if count != len(positions):
            facts.fail(key, f"{name}: {what} occurs {count} times, expected {len(positions)}")


def _check_headers(
    shard: Shard,
    tokens: np.ndarray,
    segments: np.ndarray,
    starts: np.ndarray,
    specials: SpecialTokens,
    facts: ShardFacts,
) -> None:
    role, header_len = segments["role"], segments["header_len"].astype(np.int64)
    t_name, s_name = shard.token_path.name, shard.segments_path.name
    for code, role_name in enumerate(ROLE_NAMES):
        header = np.asarray(specials.role_header_token_ids.get(role_name, []), np.int64)
        mask = role == code
        if not mask.any():
            continue
        if (header_len[mask] != len(header) + 1).any():
            facts.fail(
                "header_schema_verified",
                f"{s_name}: a {role_name} message has header_len != {len(header) + 1}",
            )
            continue
        got = tokens[starts[mask][:, None] + 1 + np.arange(len(header))]
        if not (got == header).all():
            facts.fail(
                "header_schema_verified",
                f"{t_name}: a {role_name} message's header tokens differ from the role header",
            )


def _content_positions(segments: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token positions of every message's content (between header and end token), and the
    content length of each message."""
    header_len = segments["header_len"].astype(np.int64)
    lengths = segments["length"].astype(np.int64) - header_len - 1
    first = starts + header_len
    offsets = np.cumsum(lengths) - lengths
    positions = (
        np.arange(int(lengths.sum())) - np.repeat(offsets, lengths) + np.repeat(first, lengths)
    )
    return positions, lengths


def _check_no_special_in_content(
    name: str, content: np.ndarray, forbidden: set[int], facts: ShardFacts
) -> None:
    """SPEC §2: special tokens are disabled in content, so no special id may occur there."""
    special = np.isin(content, np.fromiter(forbidden, np.int64))
    if special.any():
        facts.fail(
            "structural_control_counts_verified",
            f"{name}: special id {int(content[_first(special)])} inside message content "
            f"({int(special.sum())} times)",
        )


def _content_digest(lengths: np.ndarray, content: np.ndarray) -> str:
    digest = ContentDigest()
    digest.update(lengths, content)
    return digest.hexdigest()


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


@dataclass
class VerifyResult:
    """The recomputed contract: verify report, packing audit, manifest file entries."""

    report: VerifyReport | None  # None: the corpus could not even be listed (see problems)
    audit: PackingAudit | None
    files: list[ManifestEntry]
    problems: list[str]
    complete: bool = True  # every shard file could be read, so the totals cover the corpus


def verify_corpus(
    data_dir: Path,
    seq_len: int,
    content_sha256: list[str] | None,
    *,
    tokenizer: TextTokenizer | None = None,
    workers: int = 8,
    verified_sha256: list[str] | None = None,
) -> VerifyResult:
    """Recompute the verify report, the packing audit and the file hashes of ``data_dir``.

    Args:
        seq_len: the context length the packing audit is computed for.
        content_sha256: per shard, the builder's digest of the tokenizer output; None when
            unknown, which leaves ``content_tokens_exact_vs_source`` false.
        tokenizer: the recorded tokenizer, already loaded (the builder's); by default the
            copy in ``data_dir`` is loaded to re-encode the role headers.
        workers: threads hashing files.
        verified_sha256: the digests the verify report on disk records; a shard whose content
            matches these but not ``content_sha256`` blames the manifest, not the shard.
    """
    data_dir = Path(data_dir)
    problems: list[str] = []
    try:
        specials = read_special_tokens(data_dir)
        shards = discover_shards(data_dir)
    except ShardFormatError as exc:
        return VerifyResult(report=None, audit=None, files=[], problems=[str(exc)])
    binaries = [p for s in shards for p in s.paths]
    with ThreadPoolExecutor(max_workers=1) as hasher:
        files_future = hasher.submit(hash_entries, data_dir, binaries, workers)
        tokenizer, tokenizer_problem = _recorded_tokenizer(data_dir, specials, tokenizer)
        forbidden = content_forbidden_ids(tokenizer, specials)
        per_shard = [check_shard(s, specials, seq_len, forbidden) for s in shards]
        files = files_future.result()

    failed: dict[str, list[str]] = {}
    for facts in per_shard:
        for key, messages in facts.failed.items():
            failed.setdefault(key, []).extend(messages)
    _check_special_tokens(specials, tokenizer, tokenizer_problem, failed)
    _check_doc_keys_unique(shards, [f.doc_keys for f in per_shard], failed)
    recomputed = [f.content_sha256 for f in per_shard]
    if content_sha256 is None:
        failed.setdefault("content_tokens_exact_vs_source", []).append(
            "no build-time content digests to compare with"
        )
    else:
        for i, (shard, expected, got) in enumerate(
            zip(shards, content_sha256, recomputed, strict=False)
        ):
            if not got or expected == got:  # no digest: the shard was not readable or laid out
                continue
            if verified_sha256 is not None and verified_sha256[i : i + 1] == [got]:
                problems.append(
                    f"{SHARD_MANIFEST_FILE}: build.content_sha256[{i}] differs from shard {i}'s "
                    f"content digest, which {VERIFY_REPORT_FILE} records"
                )
            else:
                failed.setdefault("content_tokens_exact_vs_source", []).append(
                    f"{shard.token_path.name}: content tokens differ from the tokenizer output recorded at build"
                )
        if len(content_sha256) != len(shards):
            failed.setdefault("content_tokens_exact_vs_source", []).append(
                f"{len(content_sha256)} recorded content digests for {len(shards)} shards"
            )

    counts = [f.counts for f in per_shard]
    total = sum((c for c in counts if c is not None), PackingCounts())
    if total.hard_continuations:
        failed.setdefault("packing_plan_verified", []).append(
            f"{total.hard_continuations} hard continuations"
        )
    for key in sorted(failed, key=_CHECK_ORDER.index):
        problems.extend(f"{key}: {m}" for m in failed[key])

    roles = role_totals([f.roles for f in per_shard if f.roles is not None])
    report = VerifyReport(
        schema=VERIFY_SCHEMA,
        status="PASS" if not failed else "FAIL",
        shards=len(shards),
        documents=sum(f.documents for f in per_shard),
        messages=sum(f.messages for f in per_shard),
        messages_by_role={n: roles[n] for n in ROLE_NAMES if n in roles},
        trainable_messages=sum(f.roles.trainable for f in per_shard if f.roles is not None),
        tokens_including_eos=sum(f.tokens for f in per_shard),
        max_token_id=max(f.max_token_id for f in per_shard),
        vocab_size=specials.vocab_size,
        eos_id=specials.eos_id,
        pad_id=specials.pad_id,
        message_start_id=specials.message_start_id,
        message_end_id=specials.message_end_id,
        special_tokens_sha256=file_sha256(data_dir / SPECIAL_TOKENS_FILE),
        content_sha256=recomputed,
        **{key: key not in failed for key in (*REQUIRED_TRUE, "packing_plan_verified")},
    )
    audit = packing_audit_document(seq_len, counts, "packing_plan_verified" not in failed)
    complete = all(f.readable for f in per_shard)
    return VerifyResult(report, audit, files, problems, complete)


def _check_doc_keys_unique(
    shards: list[Shard], keys: list[np.ndarray], failed: dict[str, list[str]]
) -> None:
    """Document keys are unique across the corpus; a repeat names the index file holding it."""
    every = np.concatenate(keys)
    unique, first = np.unique(every, return_index=True)
    if len(unique) == len(every):
        return
    repeat = _first(np.isin(np.arange(len(every)), first, invert=True))
    shard = int(np.searchsorted(np.cumsum([len(k) for k in keys]), repeat, side="right"))
    failed.setdefault("global_doc_keys_unique", []).append(
        f"{shards[shard].index_path.name}: {len(every) - len(unique)} duplicate document keys "
        f"(first: doc_key {int(every[repeat])})"
    )


_TOKENIZERS: dict[str, TextTokenizer] = {}


def _load_tokenizer(path: Path, sha256: str) -> TextTokenizer:
    """Loading a tokenizer.json takes ~0.5 s; corpora whose copies have the same bytes share one."""
    if sha256 not in _TOKENIZERS:
        _TOKENIZERS.clear()  # keep one: a process verifies corpora of one tokenizer
        _TOKENIZERS[sha256] = load_tokenizer(path)
    return _TOKENIZERS[sha256]


def _recorded_tokenizer(
    data_dir: Path, specials: SpecialTokens, tokenizer: TextTokenizer | None
) -> tuple[TextTokenizer | None, str | None]:
    """The tokenizer copy SPECIAL_TOKENS.json records (``tokenizer`` if given), or why not."""
    copy = data_dir / specials.tokenizer.file
    try:
        digest = file_sha256(copy)
        if digest != specials.tokenizer.sha256:
            raise TokenizerError(
                f"{copy}: sha256 differs from the one recorded in {SPECIAL_TOKENS_FILE}"
            )
        return tokenizer or _load_tokenizer(copy, digest), None
    except (OSError, TokenizerError) as exc:
        return None, str(exc)


def _check_special_tokens(
    specials: SpecialTokens,
    tokenizer: TextTokenizer | None,
    tokenizer_problem: str | None,
    failed: dict[str, list[str]],
) -> None:
    """The registry is the SPEC's, and its header ids are what the recorded tokenizer encodes."""
    where = f"{SPECIAL_TOKENS_FILE}:"
    problem = control_registry_problem(specials)
    if problem:
        failed.setdefault("structural_control_counts_verified", []).append(f"{where} {problem}")
    ids = [specials.eos_id, specials.pad_id, specials.message_start_id, specials.message_end_id]
    if len(set(ids)) != len(ids) or specials.vocab_size != max(ids) + 1:
        failed.setdefault("token_id_range_verified", []).append(
            f"{where} eos/pad/control ids {ids} not distinct or not below vocab_size {specials.vocab_size}"
        )
    problem = role_registry_problem(specials)
    if problem:
        failed.setdefault("turkish_user_header_verified", []).append(f"{where} {problem}")
        return
    if tokenizer is None:
        failed.setdefault("turkish_user_header_verified", []).append(
            f"cannot re-encode the role headers: {tokenizer_problem}"
        )
        return
    encoded = tokenizer.encode_batch([f"{w}\n" for w in specials.roles.values()])
    for role, ids in zip(specials.roles, encoded, strict=True):
        if specials.role_header_token_ids.get(role) != ids:
            failed.setdefault("turkish_user_header_verified", []).append(
                f"{where} {role} header ids {specials.role_header_token_ids.get(role)} != tokenizer's {ids} for {specials.roles[role]!r}"
            )


def check_corpus(data_dir: Path, *, workers: int = 8) -> list[str]:
    """Re-verify an existing DATA_DIR: recompute everything and compare with the files on disk.

    Returns every problem found (empty: the corpus is exactly what its contract files claim),
    each naming the file at fault: the manifest's own claims first, then what the binaries
    say, then contract values that differ from the recomputation (only when the binaries are
    sound: otherwise those differences are consequences, not a second fault).
    """
    data_dir = Path(data_dir)
    try:
        docs = read_contract(data_dir)
        manifest = typed(data_dir / SHARD_MANIFEST_FILE, docs[SHARD_MANIFEST_FILE], ShardManifest)
        specials = read_special_tokens(data_dir)
    except (DatasetContractError, ShardFormatError) as exc:
        return [str(exc)]
    audit = docs[PACKING_AUDIT_FILE]
    seq_len = audit.get("seq_len")
    if not isinstance(seq_len, int) or seq_len < 1:
        return [f"{PACKING_AUDIT_FILE}: seq_len {seq_len!r} is not a positive integer"]
    verified = docs[VERIFY_REPORT_FILE].get("content_sha256")
    result = verify_corpus(
        data_dir,
        seq_len,
        manifest.build.content_sha256,
        workers=workers,
        verified_sha256=verified if isinstance(verified, list) else None,
    )
    if result.report is None or result.audit is None:
        listing = listing_problems(manifest.files, shard_files_on_disk(data_dir))
        return [f"{SHARD_MANIFEST_FILE}: {claim}" for claim in listing] + result.problems
    claims = (
        manifest_problems(manifest)
        + listing_problems(manifest.files, [entry.path for entry in result.files])
        + entry_problems(manifest.files, result.files)
        + build_problems(manifest.build, len(result.report.content_sha256), specials)
    )
    problems = [f"{SHARD_MANIFEST_FILE}: {claim}" for claim in claims] + result.problems
    if docs[VERIFY_REPORT_FILE].get("special_tokens_sha256") != result.report.special_tokens_sha256:
        problems.insert(  # the binaries were checked against changed ids: report this first
            0,
            f"{SPECIAL_TOKENS_FILE}: changed since the corpus was verified (its sha256 differs "
            f"from the one {VERIFY_REPORT_FILE} records)",
        )
    if result.complete and not result.problems:
        problems += _diff(VERIFY_REPORT_FILE, docs[VERIFY_REPORT_FILE], result.report)
        problems += _diff(PACKING_AUDIT_FILE, audit, result.audit)
    return problems


def _diff(file_name: str, on_disk: dict[str, Any], recomputed: msgspec.Struct) -> list[str]:
    """Every key whose value on disk differs from the recomputed document's."""
    expected = msgspec.to_builtins(recomputed)
    return [
        f"{file_name}: {key!r} is {on_disk.get(key, '<missing>')!r}, recomputed {expected.get(key, '<missing>')!r}"
        for key in sorted(set(on_disk) | set(expected))
        if on_disk.get(key) != expected.get(key)
    ]
