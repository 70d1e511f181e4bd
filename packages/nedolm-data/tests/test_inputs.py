"""Input formats: the same conversations as OpenAI / ShareGPT JSON lines, gzip, zstandard,
Parquet and a ``datasets`` directory give the same records; bad input names file and record;
readers hold one batch, not the file.

The files are written here with the writers' own libraries (json, gzip, zstandard, pyarrow,
``datasets``), independently of the readers under test.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.inputs import input_size, read_records
from nedolm.data.sources import INVALID_MESSAGE, InputError, RecordPolicy, Rejected, parse_record

TO_SHAREGPT = {"user": "human", "assistant": "gpt", "system": "system", "tool": "observation"}


def jsonl_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def sharegpt(record: dict[str, Any]) -> dict[str, Any]:
    """The ShareGPT (LLaMA-Factory) form of an OpenAI record, written independently here."""
    turns = []
    for m in record["messages"]:
        if m.get("tool_calls"):
            calls = [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in m["tool_calls"]
            ]
            turns.append(
                {
                    "from": "function_call",
                    "value": json.dumps(calls[0] if len(calls) == 1 else calls),
                }
            )
        else:
            turns.append({"from": TO_SHAREGPT[m["role"]], "value": m["content"]})
    out = {k: v for k, v in record.items() if k != "messages"}
    out["conversations"] = turns
    if "tools" in record:
        out["tools"] = json.dumps([t["function"] for t in record["tools"]])
    return out


def calls_renumbered(record: dict[str, Any]) -> dict[str, Any]:
    """The record with its call ids renamed call_1, call_2, ... in order (ShareGPT has no ids);
    every tool message must answer a call seen before it."""
    ids: dict[str, str] = {}
    for m in record["messages"]:
        for call in m.get("tool_calls", []):
            ids[call["id"]] = call["id"] = f"call_{len(ids) + 1}"
        if "tool_call_id" in m:
            m["tool_call_id"] = ids[m["tool_call_id"]]
    return record


def write_jsonl(path: Path, records: list[dict[str, Any]], opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def write_zst(path: Path, records: list[dict[str, Any]]) -> Path:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    path.write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    return path


def write_parquet(path: Path, records: list[dict[str, Any]], row_group_size: int = 3) -> Path:
    table = pa.Table.from_struct_array(pa.array(records))  # every key of every row
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_dataset(path: Path, records: list[dict[str, Any]]) -> Path:
    datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


WRITERS = {
    "jsonl.gz": lambda p, r: write_jsonl(p, r, gzip.open),
    "jsonl.zst": write_zst,
    "parquet": write_parquet,
    "datasets": write_dataset,
}


def read_all(path: Path, **kwargs: Any) -> list[tuple[int, bytes | Rejected]]:
    return list(read_records(path, **kwargs))


def parsed(items: list[tuple[int, bytes | Rejected]]) -> list:
    return [parse_record(raw, "same.jsonl", n, RecordPolicy()) for n, raw in items]


# --- the same records in every format ----------------------------------------------------------


def test_openai_and_alpaca_lines_pass_through_byte_for_byte(tr_chat_inputs):
    for path in tr_chat_inputs:
        lines = path.read_bytes().splitlines(keepends=True)
        assert read_all(path) == list(enumerate(lines, start=1)), path.name


@pytest.mark.parametrize("kind", [*WRITERS, "sharegpt.jsonl"])
def test_tr_chat_gives_the_same_conversations_in_every_format(tr_chat_inputs, tmp_path, kind):
    for path in tr_chat_inputs:
        records = jsonl_records(path)
        if kind == "sharegpt.jsonl":
            if "messages" not in records[0]:
                continue  # Alpaca records have no turns to write as ShareGPT
            converted = write_jsonl(
                tmp_path / f"{path.stem}.{kind}", [sharegpt(r) for r in records]
            )
        else:
            converted = WRITERS[kind](tmp_path / f"{path.stem}.{kind}", records)
        want = parsed(read_all(path))
        got = parsed(read_all(converted))
        assert all(not isinstance(c, Rejected) for c in want)
        assert got == want, f"{path.name} as {kind}"


@pytest.mark.parametrize("kind", [*WRITERS, "sharegpt.jsonl"])
def test_tool_chat_gives_the_same_records_in_every_format(fixtures_dir, tmp_path, kind):
    source = fixtures_dir / "tool_chat" / "glaive_toolcall_en_demo.jsonl"
    records = jsonl_records(source)
    if kind == "sharegpt.jsonl":
        converted = write_jsonl(tmp_path / "tools.sharegpt.jsonl", [sharegpt(r) for r in records])
        records = [calls_renumbered(r) for r in records]
    else:
        converted = WRITERS[kind](tmp_path / f"tools.{kind}", records)
    got = read_all(converted)
    assert [n for n, _ in got] == list(range(1, len(records) + 1))
    assert [json.loads(raw) for _, raw in got] == records


def test_upstream_sharegpt_matches_the_curated_openai_conversion(fixtures_dir):
    """The original LLaMA-Factory ShareGPT records against the OpenAI file converted from
    them by the data's curator (SOURCES.md), up to call ids and the added id/source keys."""
    tool_chat = fixtures_dir / "tool_chat"
    curated = [
        calls_renumbered(r) for r in jsonl_records(tool_chat / "glaive_toolcall_en_demo.jsonl")
    ]
    got = read_all(tool_chat / "glaive_toolcall_en_demo.sharegpt.jsonl")
    assert len(got) == len(curated) == 8
    for (n, raw), want in zip(got, curated, strict=True):
        record = json.loads(raw)
        assert record == {k: v for k, v in want.items() if k not in ("id", "source")}, n


def test_forced_formats_and_messages_field(tmp_path, fixtures_dir):
    records = jsonl_records(fixtures_dir / "tr_chat" / "arc_tr.jsonl")
    renamed = [{"dialog": r["messages"], "id": r["id"]} for r in records]
    table = write_parquet(tmp_path / "dialog.parquet", renamed)
    assert [json.loads(raw) for _, raw in read_all(table, messages_field="dialog")] == [
        {"messages": r["messages"], "id": r["id"]} for r in records
    ]
    lines = write_jsonl(tmp_path / "dialog.jsonl", renamed)
    assert read_all(lines, messages_field="dialog") == read_all(table, messages_field="dialog")
    # forced ShareGPT insists on ShareGPT turns; forced containers must match the file
    rejected = read_all(fixtures_dir / "tr_chat" / "arc_tr.jsonl", input_format="sharegpt")
    assert all(isinstance(r, Rejected) and r.reason == INVALID_MESSAGE for _, r in rejected)
    with pytest.raises(InputError, match=r"dialog\.parquet: is parquet, not JSON lines"):
        read_all(table, input_format="jsonl")
    with pytest.raises(InputError, match=r"dialog\.jsonl: is not a parquet input"):
        read_all(lines, input_format="parquet")


# --- bad input: one line naming the file and the record ----------------------------------------


def one_line(message: str) -> str:
    assert "\n" not in message
    return message


def test_unknown_sharegpt_from_is_a_rejection_naming_file_and_record(tmp_path):
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {
                "conversations": [
                    {"from": "human", "value": "Merhaba"},
                    {"from": "gpt", "value": "Selam"},
                ]
            },
            {
                "conversations": [
                    {"from": "human", "value": "Merhaba"},
                    {"from": "bot", "value": "Selam"},
                ]
            },
        ],
    )
    (first, record), (second, rejected) = read_all(path)
    assert (first, second) == (1, 2)
    assert parse_record(record, "chat.jsonl", 1, RecordPolicy()).messages[1].text == "Selam"
    assert isinstance(rejected, Rejected) and rejected.reason == INVALID_MESSAGE
    assert one_line(rejected.message).startswith(
        "chat.jsonl:2: conversations[1] has unknown 'from' 'bot'"
    )


def test_bad_function_call_is_a_rejection(tmp_path):
    turns = [{"from": "human", "value": "hava?"}, {"from": "function_call", "value": "{not json"}]
    path = write_jsonl(tmp_path / "calls.jsonl", [{"conversations": turns}])
    [(_, rejected)] = read_all(path)
    assert one_line(rejected.message).startswith(
        "calls.jsonl:1: conversations[1]: function_call is not JSON"
    )


def test_parquet_without_the_column_names_file_and_columns(tmp_path):
    path = write_parquet(tmp_path / "text.parquet", [{"text": "merhaba", "lang": "tr"}])
    with pytest.raises(InputError) as error:
        read_all(path)
    assert one_line(str(error.value)).endswith(
        "text.parquet: no 'messages' or 'conversations' column and no Alpaca 'instruction'/'output'"
        " (columns: text, lang); name the column with messages_field"
    )
    with pytest.raises(
        InputError, match=r"text\.parquet: no column 'dialog' \(columns: text, lang\)"
    ):
        read_all(path, messages_field="dialog")


@pytest.mark.parametrize("kind", ["jsonl.gz", "jsonl.zst"])
def test_cut_compressed_file_names_the_record_after_the_last_whole_one(
    tr_chat_inputs, tmp_path, kind
):
    source = next(p for p in tr_chat_inputs if p.name == "tquad_enelpi_train.jsonl")
    whole = WRITERS[kind](tmp_path / f"whole.{kind}", jsonl_records(source))
    cut = tmp_path / f"cut.{kind}"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    seen = []
    with pytest.raises(InputError) as error:
        for n, _ in read_records(cut):
            seen.append(n)
    assert seen == list(range(1, len(seen) + 1)) and len(seen) < 10
    assert one_line(str(error.value)).startswith(
        f"cut.{kind}:{len(seen) + 1}: the compressed stream is cut"
    )


def test_non_json_line_in_gzip_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(b'{"messages": [{"role": "user", "content": "a"}]}\n\n{"messages": [\n')
    items = read_all(path)
    assert [n for n, _ in items] == [1, 3]
    rejected = parse_record(items[1][1], path.name, items[1][0], RecordPolicy())
    assert one_line(rejected.message).startswith("broken.jsonl.gz:3: malformed JSON")


def test_missing_zstandard_names_the_extra(tmp_path, monkeypatch):
    path = write_zst(
        tmp_path / "chat.jsonl.zst", [{"messages": [{"role": "user", "content": "a"}]}]
    )
    monkeypatch.setitem(sys.modules, "zstandard", None)  # what an environment without it sees
    with pytest.raises(InputError, match=r"chat\.jsonl\.zst: .*pip install 'nedolm-data\[zstd\]'"):
        read_all(path)


def test_dataset_dict_directory_names_its_splits(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "a"}]}]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows)}
    ).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(
        InputError, match=r"dd: a DatasetDict with splits (train, test|test, train);"
    ):
        read_all(tmp_path / "dd")


# --- streaming: progress in bytes, memory of one batch -----------------------------------------


def big_records(rows: int) -> list[dict[str, Any]]:
    """Incompressible content, so the file on disk is as big as the text in it."""
    return [
        {
            "messages": [
                {"role": "user", "content": os.urandom(48).hex()},
                {"role": "assistant", "content": os.urandom(96).hex()},
            ],
            "id": i,
        }
        for i in range(rows)
    ]


@pytest.mark.parametrize("kind", list(WRITERS))
def test_readers_hold_one_batch_not_the_file(tmp_path, kind):
    records, path = big_records(25_000), tmp_path / f"big.{kind}"  # ~9 MB of text
    if kind == "parquet":
        write_parquet(path, records, row_group_size=500)
    else:
        WRITERS[kind](path, records)
    del records
    progress: list[int] = []
    arrow_peak, text = 0, 0
    tracemalloc.start()
    try:
        for _, raw in read_records(path, on_progress=progress.append):
            arrow_peak = max(arrow_peak, pa.total_allocated_bytes())
            text += len(raw)
        _, python_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert text > 8_000_000
    assert python_peak < text / 5, (python_peak, text)  # one batch of Python rows
    assert arrow_peak < text / 5, (arrow_peak, text)
    assert progress == sorted(progress) and progress[-1] == input_size(path) and len(progress) > 10


# --- the builder over every format -------------------------------------------------------------


def shard_bytes(data_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((data_dir / "shards").iterdir())}


def test_every_format_builds_byte_identical_shards(
    fixtures_dir, tr_chat_inputs, tokenizer_json, tmp_path
):
    """Tool-calling and plain conversations written as OpenAI JSONL, ShareGPT JSONL, Parquet,
    gzipped JSONL, zstd JSONL and a datasets directory: one corpus, byte for byte. Each input is
    ``train`` in its own directory, so its source name (and every record key) is train.jsonl."""
    records = jsonl_records(fixtures_dir / "tool_chat" / "glaive_toolcall_en_demo.jsonl")
    records += jsonl_records(tr_chat_inputs[0])[:20]
    inputs = {"jsonl": write_jsonl(_fresh(tmp_path / "jsonl") / "train.jsonl", records)}
    inputs["sharegpt"] = write_jsonl(
        _fresh(tmp_path / "sharegpt") / "train.jsonl", [sharegpt(r) for r in records]
    )
    for kind, write in WRITERS.items():
        name = "train" if kind == "datasets" else f"train.{kind}"
        inputs[kind] = write(_fresh(tmp_path / kind) / name, records)
    built = {}
    for kind, path in inputs.items():
        out = tmp_path / f"data-{kind}"
        report = build_corpus([path], tokenizer_json, out, BuildOptions(seq_len=4096, shards=2))
        assert [s.name for s in report.sources] == ["train.jsonl"], kind
        assert report.documents == len(records), kind
        built[kind] = shard_bytes(out)
    assert all(shards == built["jsonl"] for shards in built.values())


def _fresh(directory: Path) -> Path:
    directory.mkdir()
    return directory


def test_builder_refuses_parquet_without_the_column(tmp_path, tokenizer_json):
    path = write_parquet(tmp_path / "rows.parquet", [{"text": "merhaba"}])
    with pytest.raises(InputError, match=r"rows\.parquet: no 'messages' or 'conversations' column"):
        build_corpus([path], tokenizer_json, tmp_path / "data", BuildOptions(seq_len=256))


def test_builder_names_an_unknown_sharegpt_from(tmp_path, tokenizer_json):
    turns = [{"from": "human", "value": "Merhaba"}, {"from": "bot", "value": "Selam"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"conversations": turns}])
    with pytest.raises(InputError) as error:
        build_corpus([path], tokenizer_json, tmp_path / "data", BuildOptions(seq_len=256))
    assert str(error.value).startswith("chat.jsonl:1: conversations[1] has unknown 'from' 'bot'")
