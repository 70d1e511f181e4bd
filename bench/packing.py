"""Benchmark the adaptive packing planner at corpus scale, and its quality on the real data.

    python bench/packing.py measure   # once: real length histograms -> bench/packing_lengths.json
    python bench/packing.py plan      # planning time for 2M and 4M synthetic conversations
    python bench/packing.py quality   # packing quality on the real data vs two baselines
    python bench/packing.py           # plan + quality

The synthetic corpus draws conversation shapes (a system message or not, the number of
user/assistant turns) and per-role content lengths from histograms measured on the Turkish chat
data in ../shared/data with a real tokenizer, so long documents (chains) are as frequent as in
the real data. Planning runs on one core: the planner is single-threaded numpy and the script
pins BLAS/OpenMP to one thread. Times are medians of ``--repeats`` runs.

``quality`` builds the real Turkish chat data with the builder (``nedolm-sft prepare``'s
library call) at each ``--seq-lens`` and prints ``packing_quality``: adaptive packing against
one-conversation-per-row truncation and concatenate-then-chunk without isolation.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.packing import PackingCounts, discover_sft_shards, plan_shard
from nedolm.data.stats import packing_quality
from nedolm.data.synthetic import layout, sample_conversations

LENGTHS_FILE = Path(__file__).with_name("packing_lengths.json")
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TOKENIZER = "tokenizer/azadyasar_bpe32k/tokenizer.json"
# mistral_v1 needs ~2.3x more tokens for Turkish: more long documents, so more chains.
QUALITY_TOKENIZERS = (TOKENIZER, "tokenizer/mistral_v1/tokenizer.json")
HEADER_WORDS = {"system": "sistem", "user": "kullanici", "assistant": "asistan"}


def measure(data_dir: Path) -> dict:
    """Histograms of conversation shape and per-role content tokens in ``tr_chat/*.jsonl``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(data_dir / TOKENIZER))
    shapes: dict[str, int] = {}
    lengths: dict[str, dict[int, int]] = {role: {} for role in HEADER_WORDS}
    files = sorted(p for p in (data_dir / "tr_chat").glob("*.jsonl") if "alpaca" not in p.name)
    for path in files:
        with path.open(encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        for record in records:
            roles = [m["role"] for m in record["messages"]]
            has_system = roles[0] == "system"
            turns = roles.count("assistant")
            key = f"{int(has_system)}:{turns}"
            shapes[key] = shapes.get(key, 0) + 1
            encoded = tok.encode_batch([m["content"] for m in record["messages"]])
            for message, ids in zip(record["messages"], encoded, strict=True):
                hist = lengths[message["role"]]
                hist[len(ids)] = hist.get(len(ids), 0) + 1
    headers = {
        role: 1 + len(tok.encode(f"{word}\n").ids)  # <|mesaj_basla|> + header tokens
        for role, word in HEADER_WORDS.items()
    }
    return {
        "source": f"{data_dir.name}/tr_chat/*.jsonl (without the alpaca duplicate)",
        "tokenizer": TOKENIZER,
        "conversations": sum(shapes.values()),
        "shapes": dict(sorted(shapes.items())),  # "has_system:assistant_turns" -> count
        "header_len": headers,
        "content_tokens": {
            role: {"values": sorted(h), "counts": [h[v] for v in sorted(h)]}
            for role, h in lengths.items()
        },
    }


def time_planning(
    index: np.ndarray, segments: np.ndarray, shards: int, seq_len: int
) -> tuple[float, PackingCounts]:
    """Seconds to plan the corpus split into ``shards`` equal shards, as the trainer does."""
    bounds = np.linspace(0, len(index), shards + 1).astype(np.int64)
    pieces = []
    for lo, hi in itertools.pairwise(bounds.tolist()):
        seg_lo = int(index["segment_start"][lo])
        seg_hi = int(index["segment_start"][hi - 1] + index["segment_count"][hi - 1])
        shard_index = index[lo:hi].copy()
        shard_index["segment_start"] -= seg_lo
        shard_index["token_start"] -= shard_index["token_start"][0]
        pieces.append((shard_index, segments[seg_lo:seg_hi]))
    start = time.perf_counter()
    total = PackingCounts()
    for shard_index, shard_segments in pieces:
        total = total + plan_shard(shard_index, shard_segments, seq_len).counts
    return time.perf_counter() - start, total


def bench_planning(args: argparse.Namespace) -> None:
    params = json.loads(LENGTHS_FILE.read_text(encoding="utf-8"))
    corpora = {}
    for n in args.sizes:
        index, segments = layout(sample_conversations(params, n, seed=n))
        corpora[n] = (index, segments)
    print(
        f"{'conversations':>13} {'messages':>11} {'seq_len':>7} {'shards':>6} "
        f"{'plan s':>7} {'docs/s':>10} {'ratio':>6} {'windows':>10} {'valid':>6} {'cont':>7}"
    )
    for seq_len in args.seq_lens:
        for shards in args.shards:
            base = None
            for n, (index, segments) in corpora.items():
                runs = [
                    time_planning(index, segments, shards, seq_len) for _ in range(args.repeats)
                ]
                median = statistics.median(t for t, _ in runs)
                base = base or median
                c = runs[0][1]
                valid = c.valid_context_tokens / max(1, c.windows * (seq_len + 1))
                cont = c.turn_aligned_continuations + c.assistant_aligned_continuations
                print(
                    f"{n:>13,} {len(segments):>11,} {seq_len:>7} {shards:>6} {median:>7.2f} "
                    f"{n / median:>10,.0f} {median / base:>6.2f} {c.windows:>10,} {valid:>6.3f} "
                    f"{cont:>7,}"
                )


def bench_quality(args: argparse.Namespace) -> None:
    inputs = sorted(p for p in (args.data / "tr_chat").glob("*.jsonl") if "alpaca" not in p.name)
    print(f"real data: {len(inputs)} files of {args.data / 'tr_chat'}, 4 shards")
    for tokenizer in QUALITY_TOKENIZERS:
        print(f"\ntokenizer {tokenizer}")
        print(
            f"{'seq_len':>7} {'method':<13} {'rows':>6} {'valid ratio':>11} {'padding':>8} "
            f"{'targets':>8} {'lost':>6} {'cross-doc':>9} {'split docs':>10} {'cont':>5}"
        )
        for seq_len in args.seq_lens:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "corpus"
                options = BuildOptions(seq_len=seq_len, shards=4)
                report = build_corpus(inputs, args.data / tokenizer, out, options)
                quality = packing_quality(discover_sft_shards(out, seq_len), seq_len)
            for method in ("adaptive", "truncate", "concat_chunk"):
                q = quality[method]
                print(
                    f"{seq_len:>7} {method:<13} {q['rows']:>6,} "
                    f"{q['valid_context_ratio']:>11.4f} {q['padding_ratio']:>8.4f} "
                    f"{q['targets']:>8,} {q['targets_lost']:>6,} "
                    f"{q.get('cross_document_targets', ''):>9} "
                    f"{q.get('split_documents', ''):>10} {q.get('continuations', ''):>5}"
                )
            dropped = report.dropped
            print(f"{'':>7} kept {report.documents:,} of {report.records:,}, dropped {dropped}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "mode", nargs="?", choices=["all", "plan", "quality", "measure"], default="all"
    )
    parser.add_argument("--data", type=Path, default=SHARED_DATA)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2_000_000, 4_000_000])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 2048])
    parser.add_argument("--shards", type=int, nargs="+", default=[64, 1])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.mode == "measure":
        LENGTHS_FILE.write_text(json.dumps(measure(args.data), indent=1) + "\n", encoding="utf-8")
        print(f"wrote {LENGTHS_FILE}")
        return
    if args.mode in ("all", "plan"):
        bench_planning(args)
    if args.mode in ("all", "quality"):
        bench_quality(args)


if __name__ == "__main__":
    main()
