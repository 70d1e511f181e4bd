"""Every bad input of issue 3: a clear error naming file and line, or a counted drop."""

from __future__ import annotations

import gzip
import json
import re

import numpy as np
import pytest
import sentencepiece

from nedolm.data.builder import BuildError, BuildOptions, build_corpus
from nedolm.data.format import discover_shards
from nedolm.data.sources import BadRecordError, InputError, RecordPolicy

GOOD = {
    "messages": [{"role": "user", "content": "Merhaba"}, {"role": "assistant", "content": "Selam!"}]
}


def _chat(*messages):
    return json.dumps(
        {"messages": [dict(zip(("role", "content"), m, strict=True)) for m in messages]}
    )


BAD_LINES = {
    "invalid_json": ('{"messages": [', r"malformed JSON"),
    "invalid_utf8": (
        b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
        "invalid UTF-8 at byte",
    ),
    "missing_messages": ('{"text": "no messages here"}', "no 'messages' list"),
    "unsupported_role": (_chat(("user", "a"), ("bot", "b")), r"messages\[1\] has role 'bot'"),
    "empty_content": (
        _chat(("user", "   "), ("assistant", "b")),
        r"messages\[0\]: content is empty",
    ),
    "non_string_content": (
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": ["a", "b"]},
                    {"role": "assistant", "content": "b"},
                ]
            }
        ),
        r"messages\[0\]: content must be a string, not list",
    ),
    "control_token_in_content": (
        _chat(("user", "a <|mesaj_basla|>asistan\nb"), ("assistant", "c")),
        re.escape("contains the control string '<|mesaj_basla|>'"),
    ),
}


def _write(path, lines):
    with path.open("wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return path


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_bad_record_stops_the_build_naming_file_and_line(tmp_path, sentencepiece_model, reason):
    line, message = BAD_LINES[reason]
    path = _write(tmp_path / "chats.jsonl", [json.dumps(GOOD), line, json.dumps(GOOD)])
    with pytest.raises(InputError, match=r"^chats\.jsonl:2: .*" + message):
        build_corpus([path], sentencepiece_model, tmp_path / "out", BuildOptions(seq_len=64))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl"]  # nothing half-built


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_bad_record_is_dropped_and_counted_when_asked(tmp_path, sentencepiece_model, reason):
    line, _ = BAD_LINES[reason]
    good = [json.dumps(GOOD | {"id": i}) for i in range(3)]
    path = _write(tmp_path / "chats.jsonl", [good[0], line, good[1], good[2]])
    policy = RecordPolicy(invalid_records="drop", unsupported_roles="drop")
    report = build_corpus(
        [path], sentencepiece_model, tmp_path / "out", BuildOptions(seq_len=64, policy=policy)
    )
    (source,) = report.sources
    assert (source.records, source.kept, source.dropped) == (4, 3, {reason: 1})


def test_unsupported_role_has_its_own_policy(tmp_path, sentencepiece_model):
    line, _ = BAD_LINES["unsupported_role"]
    path = _write(tmp_path / "chats.jsonl", [json.dumps(GOOD), line])
    only_invalid = BuildOptions(seq_len=64, policy=RecordPolicy(invalid_records="drop"))
    with pytest.raises(BadRecordError, match=r"\(map it with --map-role FROM=TO\)$") as error:
        build_corpus([path], sentencepiece_model, tmp_path / "out", only_invalid)
    assert error.value.reason == "unsupported_role"


def test_no_assistant_message_and_too_long_messages_are_always_dropped(
    tmp_path, sentencepiece_model
):
    long_text = " ".join(["kelime"] * 200)
    path = _write(
        tmp_path / "chats.jsonl",
        [
            _chat(("system", "sen bir asistansın"), ("user", "merhaba")),  # no target
            _chat(("system", long_text), ("user", "a"), ("assistant", "b")),  # context too long
            _chat(("user", "a"), ("assistant", long_text)),  # target longer than any window
            json.dumps(GOOD),
        ],
    )
    report = build_corpus([path], sentencepiece_model, tmp_path / "out", BuildOptions(seq_len=64))
    assert report.sources[0].dropped == {
        "hard_continuation": 1,
        "message_too_long": 1,
        "no_target": 1,
    }
    assert report.documents == 1
    # Each length drop says which message and how long; the report keeps the longest.
    (context,) = report.drop_examples["message_too_long"]
    (target,) = report.drop_examples["hard_continuation"]
    longest = report.drop_longest
    assert context == (
        f"chats.jsonl:2: a message (system) of {longest['message_too_long']} tokens,"
        " more than a --seq-len 64 window holds (65)"
    )
    assert target == (
        f"chats.jsonl:3: a message (assistant) of {longest['hard_continuation']} tokens,"
        " more than a --seq-len 64 window holds (65)"
    )
    assert min(longest.values()) > 200  # 200 words, plus the headers and control tokens
    assert report.drop_examples["no_target"] == ["chats.jsonl:1: no assistant message is a target"]


def test_duplicate_record_ids(tmp_path, sentencepiece_model):
    path = _write(tmp_path / "chats.jsonl", [json.dumps(GOOD | {"id": "x"})] * 2)
    with pytest.raises(InputError, match=r"chats\.jsonl:2: same record id as chats\.jsonl:1"):
        build_corpus([path], sentencepiece_model, tmp_path / "out", BuildOptions(seq_len=64))
    drop = BuildOptions(seq_len=64, policy=RecordPolicy(invalid_records="drop"))
    report = build_corpus([path], sentencepiece_model, tmp_path / "out", drop)
    assert report.sources[0].dropped == {"duplicate_record": 1}


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_empty_input_is_refused(tmp_path, sentencepiece_model, content):
    (tmp_path / "empty.jsonl").write_bytes(content)
    with pytest.raises(BuildError, match=r"empty\.jsonl: holds no records"):
        build_corpus(
            [tmp_path / "empty.jsonl"],
            sentencepiece_model,
            tmp_path / "out",
            BuildOptions(seq_len=64),
        )


def test_nothing_kept_is_an_error(tmp_path, sentencepiece_model):
    path = _write(tmp_path / "chats.jsonl", [_chat(("user", "a"))])
    with pytest.raises(BuildError, match=r"no document was kept.*no_target"):
        build_corpus([path], sentencepiece_model, tmp_path / "out", BuildOptions(seq_len=64))


def test_blank_lines_are_not_records_but_line_numbers_stay_true(tmp_path, sentencepiece_model):
    path = _write(tmp_path / "chats.jsonl", [json.dumps(GOOD), "", "{oops"])
    with pytest.raises(InputError, match=r"chats\.jsonl:3: "):
        build_corpus([path], sentencepiece_model, tmp_path / "out", BuildOptions(seq_len=64))


def _only_shard(out):
    (shard,) = discover_shards(out)
    return shard


def test_unsupported_roles_error_by_default_and_map_or_drop_on_request(
    tmp_path, fixtures_dir, sentencepiece_model
):
    glaive = fixtures_dir / "tool_chat" / "glaive_toolcall_en_demo.jsonl"
    # tool is a registry role now: a role outside it is the glaive file with tool renamed.
    renamed = tmp_path / "renamed" / glaive.name
    renamed.parent.mkdir()
    renamed.write_text(
        glaive.read_text(encoding="utf-8").replace('"role":"tool"', '"role":"function"')
    )
    with pytest.raises(
        InputError, match=r"glaive_toolcall_en_demo\.jsonl:1: messages\[4\] has role 'function'"
    ):
        build_corpus([renamed], sentencepiece_model, tmp_path / "a", BuildOptions(seq_len=2048))

    dropped = build_corpus(
        [renamed],
        sentencepiece_model,
        tmp_path / "b",
        BuildOptions(seq_len=2048, policy=RecordPolicy(unsupported_roles="drop")),
    )
    records = [json.loads(line) for line in glaive.read_text(encoding="utf-8").splitlines()]
    with_tool = sum(any(m["role"] == "tool" for m in r["messages"]) for r in records)
    assert dropped.sources[0].dropped == {"unsupported_role": with_tool}

    mapped = build_corpus(
        [glaive],
        sentencepiece_model,
        tmp_path / "c",
        BuildOptions(seq_len=2048, shards=1, policy=RecordPolicy(role_map={"tool": "user"})),
    )
    assert mapped.documents == len(records)
    segments = _only_shard(tmp_path / "c").segments
    calls = sum(1 for r in records for m in r["messages"] if m.get("tool_calls"))
    assistant = segments["role"] == 2
    # every assistant message is trainable except the tool calls, which are context only
    assert int(np.count_nonzero(assistant & (segments["trainable"] == 0))) == calls
    assert int(np.count_nonzero(segments["trainable"][segments["role"] != 2])) == 0


def test_tool_call_is_rendered_as_context_text(tmp_path, sentencepiece_model):
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "saat", "arguments": '{"şehir": "İzmir"}'},
    }
    record = {
        "messages": [
            {"role": "user", "content": "İzmir'de saat kaç?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "user", "content": "14:05"},
            {"role": "assistant", "content": "Saat 14:05."},
        ]
    }
    path = _write(tmp_path / "t.jsonl", [json.dumps(record, ensure_ascii=False)])
    build_corpus([path], sentencepiece_model, tmp_path / "out", BuildOptions(seq_len=256))
    shard = _only_shard(tmp_path / "out")
    assert shard.segments["trainable"].tolist() == [0, 0, 0, 1]
    sp = sentencepiece.SentencePieceProcessor(
        model_proto=gzip.decompress(sentencepiece_model.read_bytes())
    )
    seg = shard.segments[1]
    content = shard.tokens[seg["start"] + seg["header_len"] : seg["start"] + seg["length"] - 1]
    text = sp.decode(content.tolist())
    assert text == '{"name": "saat", "arguments": {"şehir": "İzmir"}}'  # one line per call


def test_train_false_makes_an_assistant_message_context(tmp_path, sentencepiece_model):
    record = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "örnek cevap", "train": False},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "gerçek cevap"},
        ]
    }
    path = _write(tmp_path / "t.jsonl", [json.dumps(record)])
    build_corpus([path], sentencepiece_model, tmp_path / "out", BuildOptions(seq_len=256))
    assert _only_shard(tmp_path / "out").segments["trainable"].tolist() == [0, 0, 0, 1]


def test_train_flag_must_be_boolean(tmp_path, sentencepiece_model):
    record = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b", "train": "no"},
        ]
    }
    path = _write(tmp_path / "t.jsonl", [json.dumps(record)])
    with pytest.raises(
        InputError, match=r"t\.jsonl:1: messages\[1\]: 'train' must be true or false"
    ):
        build_corpus([path], sentencepiece_model, tmp_path / "out", BuildOptions(seq_len=64))


def test_role_map_target_must_be_a_registry_role():
    with pytest.raises(ValueError, match="tool=robot"):
        RecordPolicy(role_map={"tool": "robot"})


def test_byte_order_mark_is_not_bad_input(tmp_path, sentencepiece_model):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n")
    report = build_corpus([path], sentencepiece_model, tmp_path / "out", BuildOptions(seq_len=64))
    assert report.documents == 1


def test_a_role_mapped_to_assistant_is_never_a_target(tmp_path, sentencepiece_model):
    record = {
        "messages": [
            {"role": "user", "content": "hava?"},
            {"role": "tool", "content": '{"derece": 21}'},
            {"role": "assistant", "content": "21 derece."},
        ]
    }
    path = _write(tmp_path / "t.jsonl", [json.dumps(record)])
    policy = RecordPolicy(role_map={"tool": "assistant"})
    build_corpus(
        [path], sentencepiece_model, tmp_path / "out", BuildOptions(seq_len=256, policy=policy)
    )
    segments = _only_shard(tmp_path / "out").segments
    assert segments["role"].tolist() == [1, 2, 2]
    assert segments["trainable"].tolist() == [0, 0, 1]
