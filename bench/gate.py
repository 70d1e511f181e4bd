"""Benchmark the trainer's start-up data gate against the time of one epoch (issue 15).

    python bench/gate.py [--data DIR] [--tokenizer T] [--conversations 2000000] [--mfu 0.5]

The gate is what ``run`` does on rank 0 before training: ``validate_dataset_contract`` (every
check of ``verify`` but a re-encode of the sources: hashes, the recomputed report and audit,
role headers re-encoded by the tokenizer copy), then, as before, the plan recomputed from the
binaries and the role audit. It is timed on

1. the full shipped corpus (``--data``, built here with ``--tokenizer``), and
2. a synthetic corpus of ``--conversations`` conversations whose lengths follow the shipped
   corpus (``bench/packing_lengths.json``), with real role headers and contract files,

and compared with one epoch of the 0.8B preset on one H200: every row of the plan costs
6 x matmul parameters FLOPs per token (attention and the head left out, so the epoch is
underestimated and the ratio overstated), at ``--mfu`` of 989 TFLOP/s bf16 dense.
Target: gate <= 10% of one epoch.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.contract import (
    BuildProvenance,
    dump_json,
    manifest_document,
    validate_dataset_contract,
    write_contract,
)
from nedolm.data.format import SPECIAL_TOKENS_FILE, discover_shards, read_array, write_array
from nedolm.data.packing import discover_sft_shards
from nedolm.data.records import ROLE_NAMES
from nedolm.data.roles import validate_roles
from nedolm.data.sources import RecordPolicy
from nedolm.data.stats import corpus_stats
from nedolm.data.synthetic import sample_conversations, write_corpus
from nedolm.data.tokenizer import build_special_tokens, load_tokenizer
from nedolm.data.verify import verify_corpus
from nedolm.model import preset

LENGTHS_FILE = Path(__file__).with_name("packing_lengths.json")
H200_PEAK_BF16_FLOPS = 989e12


def matmul_flops_per_token(preset_name: str) -> float:
    """6 x the matmul parameters a token passes through (one morph expert; no head)."""
    cfg = preset(preset_name)
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    per_layer = d * (d + 2 * kv) + d * d + 3 * d * cfg.ffn_dim + 3 * d * cfg.morph_expert_dim
    return 6.0 * cfg.n_layers * per_layer


def timed_gate(data_dir: Path, vocab_size: int, seq_len: int) -> tuple[float, float, int]:
    """(contract gate s, plan + role audit s, windows) as ``run`` does them at start."""
    start = time.perf_counter()
    contract = validate_dataset_contract(data_dir, vocab_size, seq_len)
    gate = time.perf_counter() - start
    start = time.perf_counter()
    shards = discover_sft_shards(data_dir, seq_len)
    stats = corpus_stats(shards, seq_len)
    validate_roles(shards)
    plan = time.perf_counter() - start
    assert stats["windows"] == contract["training_windows"]
    return gate, plan, int(stats["windows"])


def shipped_corpus(data: Path, tokenizer: Path, out: Path, seq_len: int) -> Path:
    inputs = sorted(p for p in data.glob("*.jsonl") if "alpaca" not in p.name)
    drop = RecordPolicy(invalid_records="drop", unsupported_roles="drop")
    build_corpus(inputs, tokenizer, out, BuildOptions(seq_len=seq_len, shards=4, policy=drop))
    return out


def synthetic_corpus(
    tokenizer_path: Path, out: Path, conversations: int, shards: int, seq_len: int
) -> Path:
    """Measured-length conversations with the tokenizer's real role headers, verified and with
    its contract files written as the builder writes them."""
    tokenizer = load_tokenizer(tokenizer_path)
    specials = build_special_tokens(tokenizer, f"tokenizer/{tokenizer.name}")
    params = json.loads(LENGTHS_FILE.read_text(encoding="utf-8"))
    headers = specials.role_header_token_ids
    params["header_len"] = {name: len(headers[name]) + 1 for name in ROLE_NAMES}
    per_shard = conversations // shards
    write_corpus(out, [sample_conversations(params, per_shard, seed=i) for i in range(shards)])
    (out / "tokenizer").mkdir()
    (out / "tokenizer" / tokenizer.name).write_bytes(tokenizer_path.read_bytes())
    (out / SPECIAL_TOKENS_FILE).write_bytes(dump_json(msgspec.to_builtins(specials)))
    for shard in discover_shards(out):
        _real_headers(shard, headers)
        _unique_doc_keys(shard, first_key=shard.shard_id * per_shard)
    digests = verify_corpus(out, seq_len, None, tokenizer=tokenizer).report.content_sha256
    result = verify_corpus(out, seq_len, digests, tokenizer=tokenizer)
    assert not result.problems, result.problems[:3]
    build = BuildProvenance([], digests, specials.tokenizer.sha256)
    write_contract(out, result.report, result.audit, manifest_document(result.files, [], build))
    return out


def _real_headers(shard, headers: dict[str, list[int]]) -> None:
    """Replace the synthetic header ids by the tokenizer's (same lengths)."""
    tokens = np.array(read_array(shard.token_path, "tokens"))
    segments = read_array(shard.segments_path, "segments")
    index = read_array(shard.index_path, "index")
    doc_start = np.repeat(index["token_start"].astype(np.int64), index["segment_count"])
    first = np.repeat(index["segment_start"].astype(np.int64), index["segment_count"])
    length = segments["length"].astype(np.int64)
    seg_end = np.cumsum(length)
    within = seg_end - length - (seg_end - length)[first]
    starts = doc_start + within
    for code, name in enumerate(ROLE_NAMES):
        ids = np.array(headers[name], np.int64)
        at = starts[segments["role"] == code]
        tokens[at[:, None] + 1 + np.arange(len(ids))] = ids
    write_array(shard.token_path, "tokens", tokens)


def _unique_doc_keys(shard, first_key: int) -> None:
    """``write_corpus`` numbers each shard's documents from 0; a corpus's keys are unique."""
    index = np.array(read_array(shard.index_path, "index"))
    index["doc_key"] = np.arange(first_key, first_key + len(index), dtype=np.uint64)
    write_array(shard.index_path, "index", index)


def report(label: str, data_dir: Path, seq_len: int, flops_per_token: float, mfu: float) -> None:
    vocab = json.loads((data_dir / SPECIAL_TOKENS_FILE).read_text())["vocab_size"]
    gate, plan, windows = timed_gate(data_dir, vocab, seq_len)
    epoch_s = windows * seq_len * flops_per_token / (mfu * H200_PEAK_BF16_FLOPS)
    ratio = (gate + plan) / epoch_s
    print(
        f"| {label} | {windows:,} | {gate:.2f} | {plan:.2f} | {epoch_s:,.1f} | "
        f"{ratio:.2%} | {'PASS' if ratio <= 0.10 else 'FAIL'} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("/work/shared/data/tr_chat"))
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=Path("/work/shared/data/tokenizer/mistral_v1/tokenizer.json"),
    )
    parser.add_argument("--conversations", type=int, default=2_000_000)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--preset", default="nedolm-0.8b")
    parser.add_argument("--mfu", type=float, default=0.5)
    args = parser.parse_args()
    flops = matmul_flops_per_token(args.preset)
    print(
        f"epoch model: {args.preset}, {flops / 1e9:.2f} GFLOP/token (6 x matmul parameters; "
        f"attention and head left out), H200 {H200_PEAK_BF16_FLOPS / 1e12:.0f} TFLOP/s bf16 "
        f"at MFU {args.mfu:.0%} -> {args.mfu * H200_PEAK_BF16_FLOPS / flops:,.0f} tokens/s; "
        f"seq_len {args.seq_len}"
    )
    print("| corpus | windows | gate s | plan + roles s | epoch s | start-up / epoch | <= 10% |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        shipped = shipped_corpus(args.data, args.tokenizer, Path(tmp) / "shipped", args.seq_len)
        report(f"shipped {args.data.name}", shipped, args.seq_len, flops, args.mfu)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "synthetic"
        synthetic_corpus(args.tokenizer, out, args.conversations, args.shards, args.seq_len)
        report(f"synthetic {args.conversations:,} conv.", out, args.seq_len, flops, args.mfu)


if __name__ == "__main__":
    main()
