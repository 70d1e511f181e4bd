"""JSON-array inputs (``[ {...}, ... ]``: LLaMA-Factory's data/*.json, Alpaca's original file):
read one element at a time, for every record schema of JSON lines, with the same accounting;
records are named by their index; a broken array is one error naming file, record and line."""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.inputs import input_size, read_records
from nedolm.data.json_array import Oversized, array_items
from nedolm.data.sources import (
    INVALID_JSON,
    LINE_TOO_LONG,
    UNSUPPORTED_ROLE,
    InputError,
    RecordPolicy,
    Rejected,
)


def jsonl_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def write_array(path: Path, records: list[Any], opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as f:
        json.dump(records, f, ensure_ascii=False, indent=2)  # the layout of LLaMA-Factory's files
    return path


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), "utf-8")
    return path


def tokens_and_segments(data_dir: Path) -> dict[str, bytes]:
    """The shards' token and segment files: what training reads (the index files also hold the
    record keys, which name the input file)."""
    shards = sorted((data_dir / "shards").glob("*.bin"))
    return {p.name: p.read_bytes() for p in shards if not p.name.endswith(".index.bin")}


# --- the glaive demo: the upstream JSON array against the curated JSON lines ---------------------


def test_glaive_json_array_reads_as_its_sharegpt_lines(fixtures_dir):
    """The committed upstream array (records 1-8 of LLaMA-Factory's file, byte for byte) gives
    the records of the same eight written one per line, numbered by index from 0."""
    tool_chat = fixtures_dir / "tool_chat"
    array = list(read_records(tool_chat / "glaive_toolcall_en_demo.json"))
    lines = list(read_records(tool_chat / "glaive_toolcall_en_demo.sharegpt.jsonl"))
    assert [n for n, _ in array] == list(range(8))
    assert [json.loads(raw) for _, raw in array] == [json.loads(raw) for _, raw in lines]


def test_glaive_json_array_builds_the_tokens_of_its_jsonl_twin(
    fixtures_dir, tokenizer_json, tmp_path
):
    tool_chat = fixtures_dir / "tool_chat"
    options = BuildOptions(seq_len=4096, shards=2, val_shards=(1,))
    built = {}
    for name in ("glaive_toolcall_en_demo.json", "glaive_toolcall_en_demo.jsonl"):
        out = tmp_path / name
        report = build_corpus([tool_chat / name], tokenizer_json, out, options)
        (source,) = report.sources
        built[name] = (source.records, source.kept, source.dropped, tokens_and_segments(out))
    assert built["glaive_toolcall_en_demo.json"][:3] == (8, 8, {})
    assert built["glaive_toolcall_en_demo.json"] == built["glaive_toolcall_en_demo.jsonl"]


# --- every schema, plain and gzipped -------------------------------------------------------------


@pytest.mark.parametrize("compressed", [False, True], ids=["json", "json.gz"])
def test_every_schema_as_an_array_builds_what_its_lines_build(
    fixtures_dir, tokenizer_json, tmp_path, compressed
):
    """OpenAI (with tool calls), Alpaca and ShareGPT records in one array each: the same
    documents as the same records one per line, and the same accounting."""
    tr_chat, tool_chat = fixtures_dir / "tr_chat", fixtures_dir / "tool_chat"
    schemas = {
        "openai": jsonl_records(tr_chat / "arc_tr.jsonl")
        + jsonl_records(tool_chat / "glaive_toolcall_en_demo.jsonl"),
        "alpaca": jsonl_records(tr_chat / "seed_tasks_tr.alpaca.jsonl"),
        "sharegpt": jsonl_records(tool_chat / "glaive_toolcall_en_demo.sharegpt.jsonl"),
    }
    suffix, opener = (".json.gz", gzip.open) if compressed else (".json", open)
    options = BuildOptions(seq_len=4096, shards=1, val_fraction=0)
    for schema, records in schemas.items():
        built = []
        for path in (
            write_array(tmp_path / f"{schema}{suffix}", records, opener),
            write_jsonl(tmp_path / f"{schema}.jsonl", records),
        ):
            out = tmp_path / f"data-{path.name}"
            (source,) = build_corpus([path], tokenizer_json, out, options).sources
            built.append((source.records, source.kept, tokens_and_segments(out)))
        assert built[0][:2] == (len(records), len(records)), schema
        assert built[0] == built[1], schema


# --- bad input: a bad record is one record, a broken array one error -----------------------------


def test_bad_elements_are_rejections_named_by_index(tmp_path, tokenizer_json):
    good = {
        "messages": [{"role": "user", "content": "Soru"}, {"role": "assistant", "content": "Cevap"}]
    }
    text = json.dumps(
        [good, {"messages": [{"role": "narrator", "content": "x"}]}, good, "not a record"]
    )
    text = text.replace(', "not a record"', ', {"messages": [tru]}, "not a record"')
    path = tmp_path / "chats.json"
    path.write_text(text, encoding="utf-8")
    items = list(read_records(path))
    assert [n for n, _ in items] == [0, 1, 2, 3, 4]

    with pytest.raises(
        InputError, match=r"^chats\.json: record 1: messages\[0\] has role 'narrator'"
    ):
        build_corpus([path], tokenizer_json, tmp_path / "out", BuildOptions(seq_len=256))
    drop = RecordPolicy(invalid_records="drop", unsupported_roles="drop")
    report = build_corpus(
        [path], tokenizer_json, tmp_path / "out", BuildOptions(seq_len=256, shards=1, policy=drop)
    )
    (source,) = report.sources
    assert (source.records, source.kept) == (5, 2)
    assert source.dropped == {INVALID_JSON: 2, UNSUPPORTED_ROLE: 1}
    examples = report.drop_examples
    assert examples[INVALID_JSON][0].startswith("chats.json: record 3: malformed JSON")
    assert examples[INVALID_JSON][1] == (
        "chats.json: record 4: a record must be a JSON object, not str"
    )
    assert examples[UNSUPPORTED_ROLE][0].startswith("chats.json: record 1: ")


RECORD = '{"messages": [{"role": "user", "content": "a [ } \\" b"}]}'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            f"[\n{RECORD},\n{RECORD},\n{RECORD[:30]}",
            r"record 2 \(line 4\): the file ends before the JSON array is closed",
        ),
        (f'[{RECORD},\n{{"messages": [}}]', r"record 1 \(line 2\): a '}' closes a '\['"),
        (f"[{RECORD}, }}]", r"record 1 \(line 1\): a '}' closes the array's '\['"),
        (
            f"[{RECORD},\n\n]",
            r"record 1 \(line 3\): an empty record \(two commas, or a comma before '\]'\)",
        ),
        (f"[{RECORD},,{RECORD}]", r"record 1 \(line 1\): an empty record"),
        (
            f"[{RECORD}]\n[{RECORD}]",
            r"record 1 \(line 2\): data after the closing '\]' of the JSON array",
        ),
    ],
    ids=["cut", "wrong-bracket", "stray-brace", "trailing-comma", "two-commas", "two-arrays"],
)
def test_a_broken_array_is_one_error_naming_file_record_and_line(tmp_path, text, message):
    path = tmp_path / "broken.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InputError, match=rf"^broken\.json: {message}") as error:
        list(read_records(path))
    assert "\n" not in str(error.value)


def test_empty_array_and_bom(tmp_path, tokenizer_json):
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"\xef\xbb\xbf  [ \n ]\n")
    assert list(read_records(empty)) == []
    with pytest.raises(Exception, match=r"empty\.json: holds no records"):
        build_corpus([empty], tokenizer_json, tmp_path / "out", BuildOptions(seq_len=256))


def test_cut_gzip_array_names_the_record_after_the_last_whole_one(fixtures_dir, tmp_path):
    records = jsonl_records(fixtures_dir / "tr_chat" / "tquad_enelpi_train.jsonl")
    whole = write_array(tmp_path / "whole.json.gz", records, gzip.open)
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    seen = []
    with pytest.raises(InputError) as error:
        for n, _ in read_records(cut):
            seen.append(n)
    assert seen == list(range(len(seen))) and len(seen) < len(records)
    assert str(error.value).startswith(f"cut.json.gz: record {len(seen)}: the compressed stream")


# --- the scanner: chunk boundaries, long elements, memory ----------------------------------------


class Trickle(io.BytesIO):
    """A stream that returns at most ``step`` bytes per read: every chunk boundary is tried."""

    def __init__(self, data: bytes, step: int) -> None:
        super().__init__(data)
        self.step = step

    def read(self, size: int | None = -1) -> bytes:
        return super().read(self.step)


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(6 if depth < 3 else 3)
    if kind == 0:
        return "".join(
            rng.choice('ab"\\[]{},\n\u00e7\U0001f600 ') for _ in range(rng.randrange(12))
        )
    if kind == 1:
        return rng.choice([0, -1.5, 1e300, True, False, None])
    if kind == 2:
        return "\\" * rng.randrange(1, 5) + '"'
    if kind == 3:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f'k{i}\\"': random_value(rng, depth + 1) for i in range(rng.randrange(4))}


@pytest.mark.parametrize("seed", range(6))
def test_elements_survive_every_chunk_boundary(seed):
    rng = random.Random(seed)
    values = [random_value(rng) for _ in range(40)]
    data = json.dumps(values, indent=rng.choice([None, 1, 4]), ensure_ascii=rng.random() < 0.5)
    for step in (1, 2, 3, 7, 64):
        items = list(array_items(Trickle(data.encode(), step), "x.json", 1 << 20))
        assert [n for n, _ in items] == list(range(len(values)))
        assert [json.loads(raw) for _, raw in items] == values, step


def test_an_element_over_the_limit_is_skipped_not_held(tmp_path):
    """A 5 MB record (one string) and a 1 MB one (many small strings) between two short ones: it comes as a
    line_too_long rejection with its size, the next record is whole, memory stays small."""
    short = {"messages": [{"role": "user", "content": "kısa"}]}
    long_string = {"messages": [{"role": "user", "content": ('é\\"' + "x" * 60) * 80_000}]}
    long_list = {"messages": [{"role": "user", "content": "y"}] * 20_000}
    path = write_array(tmp_path / "long.json", [short, long_string, short, long_list, short])
    tracemalloc.start()
    try:
        items = list(read_records(path, max_line_bytes=100_000))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [n for n, _ in items] == [0, 1, 2, 3, 4]
    for n in (1, 3):
        rejected = items[n][1]
        assert isinstance(rejected, Rejected) and rejected.reason == LINE_TOO_LONG
        assert (
            rejected.message.startswith(f"long.json: record {n}: the record holds ")
            and "more than the limit of 100000 (--max-line-bytes)" in rejected.message
        )
    assert [json.loads(items[n][1]) for n in (0, 2, 4)] == [short] * 3
    assert peak < 2 << 20, peak  # the file is ~11 MB: a few read chunks of 256 KiB
    with path.open("rb") as f:
        items = list(array_items(f, "long.json", 100_000))
    assert isinstance(items[1][1], Oversized) and items[1][1].size > 5 << 20


def test_a_big_array_is_read_in_chunks_not_whole(tmp_path):
    records = [
        {
            "messages": [
                {"role": "user", "content": os.urandom(48).hex()},
                {"role": "assistant", "content": os.urandom(96).hex()},
            ],
            "id": i,
        }
        for i in range(25_000)
    ]
    path = write_array(tmp_path / "big.json", records)
    del records
    progress: list[int] = []
    text, ids = 0, []
    tracemalloc.start()
    try:
        for n, raw in read_records(path, on_progress=progress.append):
            text += len(raw)
            if n % 5000 == 0:
                ids.append((n, json.loads(raw)["id"]))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ids == [(n, n) for n in range(0, 25_000, 5000)] and n == 24_999
    assert text > 8_000_000
    assert peak < text / 8, (peak, text)  # a few read chunks of 256 KiB, not the file
    assert progress == sorted(progress) and progress[-1] == input_size(path) and len(progress) > 10
