"""The build reports what the tokenizer loses and what repeats, per source (issue 15).

The references are independent: the ``tokenizers`` library loaded here, and character counts
taken one character at a time.
"""

from __future__ import annotations

import gzip
import json

import pytest
from tokenizers import Tokenizer

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.sources import InputError, RecordPolicy
from nedolm.data.summary import corpus_summary
from nedolm.data.verify import check_corpus

CODE = [("user", "Kod: {a}"), ("assistant", "Sonuç {b} ve é")]  # tanai lacks { } é
LINES = [("user", "satır1\nsatır2"), ("assistant", "Tamam.\nBitti.")]  # tanai drops newlines
PLAIN = [("user", "Merhaba"), ("assistant", "Selam!")]


def _message(role, content, weight=None):
    message = {"role": role, "content": content}
    if weight is not None:
        message["weight"] = weight
    return message


def _write(path, *conversations):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            json.dumps({"messages": [_message(*m) for m in conv]}, ensure_ascii=False) + "\n"
            for conv in conversations
        ),
        encoding="utf-8",
    )
    return path


@pytest.fixture(scope="module")
def reference(tanai):
    """The tanai tokenizer as the library loads it, and its unk id read from the JSON."""
    text = gzip.decompress(tanai.read_bytes()).decode("utf-8")
    tok = Tokenizer.from_str(text)
    tok.encode_special_tokens = True
    return tok, json.loads(text)["model"]["unk_id"]


def _expected(reference, conversations):
    """(unk ids in trainable assistant content, characters lost by encode → decode)."""
    tok, unk = reference
    unk_targets = lost = 0
    for conv in conversations:
        for role, content, *weight in conv:
            ids = tok.encode(content, add_special_tokens=False).ids
            back = tok.decode(ids, skip_special_tokens=False)
            lost += sum(max(0, content.count(ch) - back.count(ch)) for ch in set(content))
            if role == "assistant" and weight != [0]:
                unk_targets += ids.count(unk)
    return unk_targets, lost


def test_unknown_tokens_in_targets_and_lost_characters_are_counted_per_source(
    tmp_path, tanai, reference
):
    weightless = [CODE[0], (*CODE[1], 0), *PLAIN]  # the same reply as context: no target
    a = _write(tmp_path / "a" / "train.jsonl", CODE, PLAIN)
    b = _write(tmp_path / "b" / "train.jsonl", LINES, weightless)
    report = build_corpus([a, b], tanai, tmp_path / "out", BuildOptions(seq_len=64))

    by_name = {s.name: s for s in report.sources}
    for name, conversations in (
        ("a/train.jsonl", [CODE, PLAIN]),
        ("b/train.jsonl", [LINES, weightless]),
    ):
        source = by_name[name]
        assert source.kept == source.records == 2
        assert (source.unk_target_tokens, source.lost_characters) == _expected(
            reference, conversations
        )
    assert by_name["a/train.jsonl"].unk_target_tokens > 0  # the check above is not vacuous
    assert by_name["b/train.jsonl"].unk_target_tokens == 0  # the unknown reply is context there
    assert _expected(reference, [LINES]) == (0, 2)  # exactly the two newlines
    assert check_corpus(tmp_path / "out") == []

    summary = corpus_summary(tmp_path / "out")
    assert summary["reported"] == {
        "unk_target_tokens": sum(s.unk_target_tokens for s in report.sources),
        "lost_characters": sum(s.lost_characters for s in report.sources),
        "duplicate_conversations": 0,
    }


def test_exact_duplicates_are_counted_and_dropped_only_with_dedup(tmp_path, tanai):
    a = _write(tmp_path / "a" / "train.jsonl", CODE, PLAIN, PLAIN)  # one repeat inside a
    b = _write(tmp_path / "b" / "train.jsonl", LINES, CODE)  # one repeat of a's first record
    context_reply = [CODE[0], (*CODE[1], 0), *PLAIN]
    weighted = _write(tmp_path / "c" / "train.jsonl", context_reply, [*CODE, *PLAIN])  # same
    # tokens, but one trains the first reply and the other does not: not a repeat

    kept = build_corpus([a, b, weighted], tanai, tmp_path / "all", BuildOptions(seq_len=64))
    assert [s.duplicate_conversations for s in kept.sources] == [1, 1, 0]
    assert kept.documents == 7 and kept.dropped == {}

    options = BuildOptions(seq_len=64, dedup=True)
    deduped = build_corpus([a, b, weighted], tanai, tmp_path / "dedup", options)
    assert [s.dropped for s in deduped.sources] == [
        {"duplicate_conversation": 1},
        {"duplicate_conversation": 1},
        {},
    ]
    assert [s.duplicate_conversations for s in deduped.sources] == [1, 1, 0]
    assert deduped.documents == 5
    for source in deduped.sources:
        assert source.records == source.kept + sum(source.dropped.values())
    assert deduped.drop_examples["duplicate_conversation"] == [
        "a/train.jsonl:3: same conversation as a/train.jsonl:2",
        "b/train.jsonl:2: same conversation as a/train.jsonl:1",
    ]
    assert check_corpus(tmp_path / "dedup") == []


def test_typed_unk_is_counted_not_refused(tmp_path, tanai, reference):
    """``<unk>`` only stands for text the tokenizer cannot encode, so typing it is no control
    token: the record is kept and its <unk> id counted like any unknown character."""
    conv = [("user", "Bu ne?"), ("assistant", "Bir etiket: <unk>")]
    path = _write(tmp_path / "chats.jsonl", PLAIN, conv)
    report = build_corpus([path], tanai, tmp_path / "out", BuildOptions(seq_len=64))
    assert report.sources[0].kept == 2
    assert report.sources[0].unk_target_tokens == _expected(reference, [conv])[0] > 0


def test_records_with_unknown_tokens_can_be_dropped_or_refused(tmp_path, tanai, reference):
    path = _write(tmp_path / "chats.jsonl", PLAIN, LINES, CODE)
    tok, unk = reference
    with_unk = [
        conv
        for conv in (PLAIN, LINES, CODE)
        if any(unk in tok.encode(c, add_special_tokens=False).ids for _, c in conv)
    ]
    assert with_unk == [CODE]

    drop = BuildOptions(seq_len=64, policy=RecordPolicy(unknown_tokens="drop"))
    report = build_corpus([path], tanai, tmp_path / "out", drop)
    assert report.sources[0].dropped == {"unknown_token": 1}
    assert report.sources[0].unk_target_tokens == 0 and report.documents == 2

    refuse = BuildOptions(seq_len=64, policy=RecordPolicy(unknown_tokens="error"))
    with pytest.raises(InputError, match=r"chats\.jsonl:3: messages\[0\] holds 2 <unk> ids"):
        build_corpus([path], tanai, tmp_path / "refused", refuse)
