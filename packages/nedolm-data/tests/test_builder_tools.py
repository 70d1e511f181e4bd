"""Tool-calling conversations through the builder: the tool role, rendered calls and schemas.

Target counts are recomputed here from the source JSON with the tokenizer alone (the text form
of a call is written out independently of ``nedolm.data.render``), so a builder that trains the
wrong messages or renders calls differently fails.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.contract import PACKING_AUDIT_FILE, VERIFY_REPORT_FILE
from nedolm.data.format import read_special_tokens
from nedolm.data.sources import (
    DUPLICATE_RECORD,
    INVALID_JSON,
    INVALID_TOOL_CALL,
    NON_STRING_CONTENT,
    UNSUPPORTED_ROLE,
    InputError,
    RecordPolicy,
)
from nedolm.data.tokenizer import load_tokenizer
from nedolm.data.verify import check_corpus


def tool_chat(fixtures_dir: Path) -> Path:
    return fixtures_dir / "tool_chat" / "glaive_toolcall_en_demo.jsonl"


def records_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def independent_targets(records: list[dict[str, Any]], tokenizer: Any, train_calls: bool) -> int:
    """Trainable tokens from the source: each target assistant message's text + its end token."""
    texts = []
    for record in records:
        for message in record["messages"]:
            if message["role"] != "assistant" or (message.get("tool_calls") and not train_calls):
                continue
            lines = [
                f'{{"name": "{call["function"]["name"]}", "arguments": {call["function"]["arguments"]}}}'
                for call in message.get("tool_calls", [])
            ]
            content = message.get("content") or ""
            texts.append("\n".join(([content] if content.strip() else []) + lines))
    return sum(len(ids) + 1 for ids in tokenizer.encode_batch(texts))


@pytest.mark.parametrize("train_calls", [False, True])
def test_tool_chat_trains_the_independently_counted_targets(
    fixtures_dir, tokenizer_json, tmp_path, train_calls
):
    source = tool_chat(fixtures_dir)
    records = records_of(source)
    out = tmp_path / "data"
    policy = RecordPolicy(train_tool_calls=train_calls)
    report = build_corpus([source], tokenizer_json, out, BuildOptions(seq_len=4096, policy=policy))

    assert report.dropped == {} and report.documents == len(records) == 8
    audit = json.loads((out / PACKING_AUDIT_FILE).read_text())
    want = independent_targets(records, load_tokenizer(tokenizer_json), train_calls)
    assert audit["assistant_target_tokens"] == want
    verify = json.loads((out / VERIFY_REPORT_FILE).read_text())
    tool_messages = sum(m["role"] == "tool" for r in records for m in r["messages"])
    assert verify["status"] == "PASS" and verify["messages_by_role"]["tool"] == tool_messages > 0
    assert read_special_tokens(out).roles["tool"] == "araç"
    assert check_corpus(out) == []


def test_calls_are_context_unless_trained(fixtures_dir, tokenizer_json, tmp_path):
    source = tool_chat(fixtures_dir)
    targets = {}
    for train_calls in (False, True):
        out = tmp_path / f"data-{train_calls}"
        options = BuildOptions(seq_len=4096, policy=RecordPolicy(train_tool_calls=train_calls))
        build_corpus([source], tokenizer_json, out, options)
        targets[train_calls] = json.loads((out / PACKING_AUDIT_FILE).read_text())
    assert targets[True]["assistant_target_tokens"] > targets[False]["assistant_target_tokens"]


def test_a_corpus_without_tools_registers_only_the_seed_roles(fixture_corpus):
    seed_registry = {"system": "sistem", "user": "kullanici", "assistant": "asistan"}
    specials = read_special_tokens(fixture_corpus)
    assert specials.roles == seed_registry
    assert set(specials.role_header_token_ids) == set(seed_registry)
    verify = json.loads((fixture_corpus / VERIFY_REPORT_FILE).read_text())
    assert set(verify["messages_by_role"]) == set(seed_registry)


def test_tools_schema_goes_into_the_system_message(fixtures_dir, tokenizer_json, tmp_path):
    """The first record has tools and no system message: the builder adds one holding them."""
    record = records_of(tool_chat(fixtures_dir))[0]
    assert record["tools"] and record["messages"][0]["role"] != "system"
    out = tmp_path / "data"
    source = tmp_path / "one.jsonl"
    source.write_text(json.dumps(record) + "\n")
    build_corpus([source], tokenizer_json, out, BuildOptions(seq_len=4096))
    verify = json.loads((out / VERIFY_REPORT_FILE).read_text())
    assert verify["messages_by_role"]["system"] == 1
    assert verify["messages"] == len(record["messages"]) + 1


def write_lines(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def chat(user: str, answer: str, **extra: Any) -> str:
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return json.dumps({"messages": messages, **extra}, ensure_ascii=False)


BAD_CALL = json.dumps(
    {
        "messages": [
            {"role": "user", "content": "Hava nasıl?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "hava", "arguments": "{şehir: Ankara"}}],
            },
            {"role": "tool", "content": "güneşli"},
            {"role": "assistant", "content": "Güneşli."},
        ]
    },
    ensure_ascii=False,
)


def test_invalid_tool_call_arguments_name_file_record_and_call(tokenizer_json, tmp_path):
    source = write_lines(tmp_path / "calls.jsonl", [chat("Merhaba", "Selam"), BAD_CALL])
    with pytest.raises(InputError) as error:
        build_corpus([source], tokenizer_json, tmp_path / "data", BuildOptions(seq_len=512))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("calls.jsonl:2: messages[1].tool_calls[0] (hava): arguments are")


def test_two_inputs_with_the_same_file_name_do_not_collide(tokenizer_json, tmp_path):
    """Issue 15 bug 1: record keys and report names use the path, not the file name."""
    a = write_lines(tmp_path / "a" / "train.jsonl", [chat("Bir", "İki"), chat("Üç", "Dört")])
    b = write_lines(tmp_path / "b" / "train.jsonl", [chat("Beş", "Altı"), chat("Yedi", "Sekiz")])
    for mode in ("error", "drop"):
        options = BuildOptions(seq_len=512, policy=RecordPolicy(invalid_records=mode))
        report = build_corpus([a, b], tokenizer_json, tmp_path / f"data-{mode}", options)
        assert [s.name for s in report.sources] == ["a/train.jsonl", "b/train.jsonl"]
        assert report.documents == 4 and DUPLICATE_RECORD not in report.dropped


def test_skip_drops_bad_records_by_reason_with_locations(tokenizer_json, tmp_path):
    lines = [
        chat("Merhaba", "Selam"),
        '{"messages": [',  # malformed JSON
        json.dumps({"messages": [{"role": "user", "content": 7}]}),  # wrong type
        json.dumps({"messages": [{"role": "narrator", "content": "x"}]}),  # unsupported role
        BAD_CALL,
        chat("Nasılsın?", "İyiyim"),
    ]
    source = write_lines(tmp_path / "mixed" / "bad.jsonl", lines)
    policy = RecordPolicy(invalid_records="drop", unsupported_roles="drop")
    report = build_corpus(
        [source], tokenizer_json, tmp_path / "data", BuildOptions(seq_len=512, policy=policy)
    )
    (only,) = report.sources
    assert only.records == len(lines) == only.kept + sum(only.dropped.values())
    assert only.dropped == {
        INVALID_JSON: 1,
        NON_STRING_CONTENT: 1,
        UNSUPPORTED_ROLE: 1,
        INVALID_TOOL_CALL: 1,
    }
    assert [e.split(": ")[0] for e in report.drop_examples[INVALID_JSON]] == ["bad.jsonl:2"]
    assert report.drop_examples[UNSUPPORTED_ROLE][0].startswith("bad.jsonl:4: messages[0]")
    assert report.drop_examples[INVALID_TOOL_CALL][0].startswith("bad.jsonl:5: ")


def test_drop_examples_stop_at_twenty(tokenizer_json, tmp_path):
    lines = [chat("Merhaba", "Selam")] + ["{not json"] * 25
    source = write_lines(tmp_path / "many.jsonl", lines)
    policy = RecordPolicy(invalid_records="drop")
    report = build_corpus(
        [source], tokenizer_json, tmp_path / "data", BuildOptions(seq_len=512, policy=policy)
    )
    assert report.dropped == {INVALID_JSON: 25}
    assert [e.split(": ")[0] for e in report.drop_examples[INVALID_JSON]] == [
        f"many.jsonl:{n}" for n in range(2, 22)
    ]
