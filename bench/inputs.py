"""Benchmark the input readers: the same records as JSON lines, ShareGPT, gzip, zstandard,
Parquet and a ``datasets`` directory, read with ``read_records`` and parsed with
``parse_record`` (what the builder does before tokenizing).

    python bench/inputs.py [--data DIR] [--copies 4] [--repeats 3] [--build-copies 1]

Each format is timed in the same run and compared with plain JSON lines (ratio = its
records/s over JSON lines' records/s). Then the whole builder (``build_corpus``: read, parse,
tokenize, write shards, verify) runs over the same records as JSON lines and as Parquet, and
the Parquet/JSON lines throughput ratio is printed: issue 13's target is >= 0.9x.
All figures are medians of ``--repeats`` runs over page-cached files.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.inputs import input_size, read_records
from nedolm.data.sources import RecordPolicy, Rejected, parse_record

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TOKENIZER = (
    Path(__file__).resolve().parents[1]
    / "packages/nedolm-data/tests/fixtures/tokenizer/mistral_v1.tokenizer.json.gz"
)
SHAREGPT_FROM = {"user": "human", "assistant": "gpt", "system": "system"}


def load(data: Path, copies: int) -> list[dict[str, Any]]:
    records = []
    for path in sorted(data.glob("*.jsonl")):
        records += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    if not records:
        raise SystemExit(f"{data}: no *.jsonl records (pass --data)")
    return records * copies


def lines(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def sharegpt(record: dict[str, Any]) -> dict[str, Any]:
    if "messages" not in record:
        return record
    turns = [{"from": SHAREGPT_FROM[m["role"]], "value": m["content"]} for m in record["messages"]]
    return {"conversations": turns, **{k: v for k, v in record.items() if k != "messages"}}


def write_inputs(records: list[dict[str, Any]], scratch: Path) -> dict[str, Path]:
    text = lines(records)
    paths = {
        "jsonl": scratch / "chat.jsonl",
        "sharegpt jsonl": scratch / "chat.sharegpt.jsonl",
        "jsonl.gz": scratch / "chat.jsonl.gz",
        "jsonl.zst": scratch / "chat.jsonl.zst",
        "parquet": scratch / "chat.parquet",
        "datasets dir": scratch / "chat.dataset",
    }
    paths["jsonl"].write_bytes(text)
    paths["sharegpt jsonl"].write_bytes(lines([sharegpt(r) for r in records]))
    paths["jsonl.gz"].write_bytes(gzip.compress(text, compresslevel=6))
    paths["jsonl.zst"].write_bytes(zstandard.ZstdCompressor().compress(text))
    table = pa.Table.from_struct_array(pa.array(records))  # every key of every row
    pq.write_table(table, paths["parquet"])  # pyarrow's defaults: snappy, 1 Mi-row groups
    datasets.Dataset(table).save_to_disk(str(paths["datasets dir"]))
    return paths


def read_and_parse(path: Path) -> int:
    policy, count = RecordPolicy(), 0
    for number, raw in read_records(path):
        result = raw if isinstance(raw, Rejected) else parse_record(raw, "chat", number, policy)
        if isinstance(result, Rejected):
            raise SystemExit(f"bench input rejected: {result.message}")
        count += 1
    return count


def bench_build(
    records: list[dict[str, Any]], scratch: Path, tokenizer: Path, repeats: int
) -> dict[str, float]:
    """Records/s of ``build_corpus`` over the records as JSON lines and as Parquet. Ids are
    dropped so repeated records get distinct keys (their line or row number)."""
    unkeyed = [{k: v for k, v in r.items() if k != "id"} for r in records]
    paths = {"jsonl": scratch / "build.jsonl", "parquet": scratch / "build.parquet"}
    paths["jsonl"].write_bytes(lines(unkeyed))
    pq.write_table(pa.Table.from_struct_array(pa.array(unkeyed)), paths["parquet"])
    times: dict[str, list[float]] = {name: [] for name in paths}
    documents = {}
    for run in range(repeats):  # interleaved, so load from other processes hits both alike
        for name, path in paths.items():
            out = scratch / f"corpus-{name}-{run}"
            start = time.perf_counter()
            report = build_corpus([path], tokenizer, out, BuildOptions(seq_len=4096, shards=4))
            times[name].append(time.perf_counter() - start)
            documents[name] = (report.records, report.documents, report.tokens)
            shutil.rmtree(out)
    assert documents["parquet"] == documents["jsonl"], documents  # the same work
    return {name: len(records) / statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=SHARED_DATA / "tr_chat")
    parser.add_argument("--copies", type=int, default=4, help="repeat the records")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--build-copies", type=int, default=1, help="records for the builder")
    parser.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    args = parser.parse_args()
    records = load(args.data, args.copies)
    with tempfile.TemporaryDirectory() as scratch:
        paths = write_inputs(records, Path(scratch))
        rates = {}
        for name, path in paths.items():
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                assert read_and_parse(path) == len(records)
                times.append(time.perf_counter() - start)
            rates[name] = (input_size(path), len(records) / statistics.median(times))
    print(f"{len(records):,} records from {args.data}, medians of {args.repeats} runs")
    print(f"{'input':<16}{'MB':>8}{'records/s':>12}{'vs jsonl':>10}")
    for name, (size, rate) in rates.items():
        print(f"{name:<16}{size / 1e6:>8.1f}{rate:>12,.0f}{rate / rates['jsonl'][1]:>10.2f}")
    built = load(args.data, args.build_copies)
    with tempfile.TemporaryDirectory() as scratch:
        build = bench_build(built, Path(scratch), args.tokenizer, args.repeats)
    print(f"builder over {len(built):,} records ({args.tokenizer.name}, seq_len 4096):")
    for name, rate in build.items():
        print(f"  {name:<10}{rate:>10,.0f} records/s")
    print(f"  parquet/jsonl = {build['parquet'] / build['jsonl']:.2f}x (target >= 0.9x)")


if __name__ == "__main__":
    main()
