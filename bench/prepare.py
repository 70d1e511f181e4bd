"""Benchmark the corpus builder and the verifier's hashing against their bare references.

    python bench/prepare.py [--data DIR] [--tokenizer T] [--copies 4] [--repeats 3] [--hash-mb 512]

1. Builder: ``build_corpus`` on the real Turkish chat files, repeated ``--copies`` times with
   fresh ids (everything: parsing, encoding,
   layout, writing, verifying, hashing) against the tokenizer's bare ``encode_batch`` of the
   very same message texts, already parsed, in the same run. Target: >= 50% of its records/s.
   Run in-process (one worker: ``nedolm-sft prepare --workers 1``) and with a pool of two.
2. Hashing: the verifier's ``hash_files`` (threads) against ``sha256sum`` on the same files
   (page-cached shard-sized files). Target: >= 80% of sha256sum's MB/s.

All figures are medians of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.hashing import hash_files
from nedolm.data.tokenizer import load_tokenizer

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def message_texts(paths: list[Path]) -> tuple[int, list[str]]:
    records, texts = 0, []
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                records += 1
                texts += [m["content"] for m in json.loads(line)["messages"]]
    return records, texts


def replicate(inputs: list[Path], copies: int, scratch: Path) -> list[Path]:
    """Each input repeated ``copies`` times with fresh record ids, so fixed costs (loading the
    tokenizer, fsync, verifying) weigh about as little as in a real corpus."""
    out = []
    for path in inputs:
        target = scratch / path.name
        with target.open("w", encoding="utf-8") as f:
            for copy in range(copies):
                for n, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
                    record = json.loads(line)
                    record["id"] = f"{n}-{copy}"
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
        out.append(target)
    return out


def bench_builder(
    inputs: list[Path], tokenizer_path: Path, repeats: int, scratch: Path
) -> list[tuple]:
    records, texts = message_texts(inputs)
    tokenizer = load_tokenizer(tokenizer_path)
    tokens = sum(len(ids) for ids in tokenizer.encode_batch(texts))
    bare = median_seconds(lambda: tokenizer.encode_batch(texts), repeats)
    rows = [("bare encode_batch", records / bare, tokens / bare, 1.0)]
    for workers in (1, 2):
        out = scratch / f"corpus-{workers}"

        def build(out: Path = out, workers: int = workers) -> None:
            shutil.rmtree(out, ignore_errors=True)
            build_corpus(
                inputs, tokenizer_path, out, BuildOptions(seq_len=4096, shards=8, workers=workers)
            )

        seconds = median_seconds(build, repeats)
        rows.append(
            (
                f"build_corpus --workers {workers}",
                records / seconds,
                tokens / seconds,
                bare / seconds,
            )
        )
    return rows


def bench_hashing(scratch: Path, total_mb: int, repeats: int) -> list[tuple]:
    files = []
    rng = np.random.default_rng(0)
    for i in range(8):  # 8 shard-sized files, like one tokens file per shard
        path = scratch / f"sft-{i:05d}-of-00008.tokens.bin"
        path.write_bytes(rng.integers(0, 256, total_mb * (1 << 20) // 8, dtype=np.uint8).tobytes())
        files.append(path)
    subprocess.run(
        ["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True
    )  # warm the cache
    reference = median_seconds(
        lambda: subprocess.run(
            ["sha256sum", *map(str, files)], stdout=subprocess.DEVNULL, check=True
        ),
        repeats,
    )
    ours = median_seconds(lambda: hash_files(scratch, files), repeats)
    mb = total_mb
    expected = subprocess.run(
        ["sha256sum", *map(str, files)], capture_output=True, text=True, check=True
    ).stdout.split()[::2]
    assert [e["sha256"] for e in hash_files(scratch, files)] == expected
    return [
        ("sha256sum", mb / reference, 1.0),
        (f"hash_files ({os.cpu_count()} cpus)", mb / ours, reference / ours),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=SHARED_DATA / "tr_chat")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=SHARED_DATA / "tokenizer" / "mistral_v1" / "tokenizer.json",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copies", type=int, default=4, help="repeat the inputs (fresh ids)")
    parser.add_argument("--hash-mb", type=int, default=512)
    args = parser.parse_args()
    inputs = sorted(p for p in args.data.glob("*.jsonl") if "alpaca" not in p.name)
    with tempfile.TemporaryDirectory() as scratch:
        inputs = replicate(inputs, args.copies, Path(scratch))
        rows = bench_builder(inputs, args.tokenizer, args.repeats, Path(scratch))
        print(
            f"builder on {len(inputs)} files of {args.data} x{args.copies} with"
            f" {args.tokenizer.name}, medians of {args.repeats}"
        )
        print(f"{'':<28}{'records/s':>12}{'tokens/s':>14}{'ratio':>8}")
        for name, rps, tps, ratio in rows:
            print(f"{name:<28}{rps:>12,.0f}{tps:>14,.0f}{ratio:>8.2f}")
        hashing = bench_hashing(Path(scratch), args.hash_mb, args.repeats)
    print(f"\nhashing {args.hash_mb} MB in 8 files (page cache), medians of {args.repeats}")
    print(f"{'':<28}{'MB/s':>12}{'ratio':>8}")
    for name, mbps, ratio in hashing:
        print(f"{name:<28}{mbps:>12,.0f}{ratio:>8.2f}")


if __name__ == "__main__":
    main()
