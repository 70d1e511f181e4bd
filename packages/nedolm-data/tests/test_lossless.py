"""Tokenizers the builder trusts to lose nothing are checked against real text; any other
pipeline is decoded (``nedolm.data.lossless``)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.tokenizer import load_tokenizer


def _messages(fixtures_dir: Path) -> list[str]:
    """Every string content of the committed real chat records (tr_chat and tool_chat)."""
    texts = []
    for path in sorted(fixtures_dir.glob("*_chat/*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            for message in record.get("messages", []):
                if isinstance(message.get("content"), str):
                    texts.append(message["content"])
    return texts


def _round_trips(tokenizer_file: Path, texts: list[str]) -> list[str]:
    """The texts the ``tokenizers`` library itself does not give back."""
    raw = tokenizer_file.read_bytes()
    tok = Tokenizer.from_str((gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode())
    tok.encode_special_tokens = True
    encoded = tok.encode_batch(texts, add_special_tokens=False)
    back = tok.decode_batch([e.ids for e in encoded], skip_special_tokens=False)
    return [t for t, b in zip(texts, back, strict=True) if t != b]


def _edited(tokenizer_json: Path, tmp_path: Path, edit) -> Path:
    doc = json.loads(gzip.decompress(tokenizer_json.read_bytes()))
    edit(doc)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def test_mistral_is_trusted_and_really_gives_every_real_message_back(tokenizer_json, fixtures_dir):
    texts = _messages(fixtures_dir)
    assert len(texts) > 1000
    assert load_tokenizer(tokenizer_json).lossless
    assert _round_trips(tokenizer_json, texts) == []


def test_byte_level_bpe_is_trusted_and_gives_every_real_message_back(tmp_path, fixtures_dir):
    texts = _messages(fixtures_dir)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts[:300], trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    assert load_tokenizer(path).lossless
    assert _round_trips(path, texts) == []


def _nfkc(doc):
    doc["normalizer"]["normalizers"].append({"type": "NFKC"})


def _no_byte_fallback(doc):
    doc["model"]["byte_fallback"] = False


def _whitespace_split(doc):
    doc["pre_tokenizer"] = {"type": "Whitespace"}


def _decoder_strips_more(doc):
    doc["decoder"]["decoders"].append({"type": "Strip", "content": " ", "start": 1, "stop": 0})


@pytest.mark.parametrize(
    "edit", [_nfkc, _no_byte_fallback, _whitespace_split, _decoder_strips_more]
)
def test_any_other_pipeline_is_decoded(tokenizer_json, tmp_path, edit):
    path = _edited(tokenizer_json, tmp_path, edit)
    assert not load_tokenizer(path).lossless


def test_shipped_lossy_tokenizers_are_decoded(tanai, fixtures_dir):
    assert not load_tokenizer(tanai).lossless
    assert _round_trips(tanai, _messages(fixtures_dir))  # so the counts matter there


def test_a_trusted_tokenizer_reports_no_lost_characters(tmp_path, tokenizer_json, tr_chat_inputs):
    report = build_corpus(
        tr_chat_inputs, tokenizer_json, tmp_path / "out", BuildOptions(seq_len=1024)
    )
    assert [s.lost_characters for s in report.sources] == [0] * len(report.sources)


def test_a_space_mark_in_the_text_is_counted_by_a_trusted_tokenizer(tmp_path, tokenizer_json):
    """A ``▁`` typed in the text decodes as a space, even through a trusted pipeline."""
    mark = "\u2581"
    records = [
        {"messages": [{"role": "user", "content": "Soru"}, {"role": "assistant", "content": c}]}
        for c in (f"bir{mark}iki {mark}{mark}", "Cevap")
    ]
    source = tmp_path / "marked.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    assert load_tokenizer(tokenizer_json).lossless
    assert _round_trips(tokenizer_json, [records[0]["messages"][1]["content"]])  # truly lost
    options = BuildOptions(seq_len=256, shards=1, val_fraction=0)
    report = build_corpus([source], tokenizer_json, tmp_path / "out", options)
    assert [s.lost_characters for s in report.sources] == [3]
