"""Tokenizer adapters: the two libraries agree, special strings stay text, ids follow SPEC §2."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.records import ROLE_TOOL
from nedolm.data.sources import InputError, RecordPolicy
from nedolm.data.tokenizer import (
    TokenizerError,
    build_special_tokens,
    load_tokenizer,
    registered_special_tokens,
)


def _contents(paths):
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            for message in record.get("messages", []):
                yield message["content"]


def test_tokenizer_json_and_sentencepiece_agree_on_real_data(
    tr_chat_inputs, tokenizer_json, sentencepiece_model
):
    hf, sp = load_tokenizer(tokenizer_json), load_tokenizer(sentencepiece_model)
    assert (hf.kind, sp.kind) == ("tokenizers", "sentencepiece")
    texts = list(_contents(tr_chat_inputs))
    assert len(texts) > 500
    assert hf.encode_batch(texts) == sp.encode_batch(texts)
    for text, ids in zip(texts[:50], hf.encode_batch(texts[:50]), strict=True):
        assert hf.decode(ids) == text == sp.decode(ids)  # mistral_v1 is lossless


def test_both_formats_list_the_same_vocabulary_pieces(tokenizer_json, sentencepiece_model):
    hf, sp = load_tokenizer(tokenizer_json), load_tokenizer(sentencepiece_model)
    pieces = hf.pieces()
    assert len(pieces) == hf.base_vocab_size == 32000
    assert pieces == sp.pieces()
    word = hf.encode_batch(["merhaba"])[0][0]
    assert pieces[word].startswith("\u2581")


def test_special_ids_follow_the_spec(tokenizer_json):
    specials = build_special_tokens(load_tokenizer(tokenizer_json), "tokenizer/x.json.gz")
    assert (specials.eos_id, specials.message_start_id, specials.message_end_id) == (
        2,
        32000,
        32001,
    )
    assert specials.pad_id == 32002  # mistral has no pad token: the next free id
    assert specials.vocab_size == 32003
    seed_roles = {"system": "sistem", "user": "kullanici", "assistant": "asistan"}
    assert specials.roles == seed_roles | {"tool": "araç"}  # the whole registry, for encoding
    # A corpus registers the seed's roles, plus tool only when it holds tool messages.
    assert registered_special_tokens(specials, set()).roles == seed_roles
    assert registered_special_tokens(specials, {ROLE_TOOL}).roles == specials.roles
    tok = load_tokenizer(tokenizer_json)
    assert specials.role_header_token_ids["user"] == tok.encode_batch(["kullanici\n"])[0]
    assert [c.token for c in specials.control_tokens] == ["<|mesaj_basla|>", "<|mesaj_bitir|>"]


@pytest.mark.parametrize("text", ["</s>", "<s> merhaba </s>", "<unk>", "<|mesaj_bitir|>"])
def test_typed_special_strings_are_plain_text(tokenizer_json, sentencepiece_model, text):
    for path in (tokenizer_json, sentencepiece_model):
        tok = load_tokenizer(path)
        (ids,) = tok.encode_batch([text])
        assert not {0, 1, 2} & set(ids)
        assert max(ids) < 32000
        assert tok.decode(ids) == text


def _unigram_with_eos_piece(path):
    """A real Unigram tokenizer whose vocabulary holds ``</s>`` as a scoring piece (like tanai)."""
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0), ("<pad>", 0.0), ("▁", -2.0)]
    vocab += [(c, -3.0) for c in "abcdefghijklmnoprstuvyzıöüşçğ<>/!"]
    vocab += [("▁" + c, -2.5) for c in "abcdefghijklmnoprstuvyzıöüşçğ"]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>", "<pad>")])
    tok.save(str(path))
    return path


def test_a_tokenizer_that_turns_typed_eos_into_eos_is_caught(tmp_path):
    tokenizer = _unigram_with_eos_piece(tmp_path / "tokenizer.json")
    loaded = load_tokenizer(tokenizer)
    assert (loaded.eos_id, loaded.pad_id) == (2, 3)
    (ids,) = loaded.encode_batch(["son </s>"])
    assert 2 in ids  # the library really does this, even with special-token parsing off

    good = {
        "messages": [
            {"role": "user", "content": "selam"},
            {"role": "assistant", "content": "merhaba"},
        ]
    }
    bad = {
        "messages": [
            {"role": "user", "content": "son </s>"},
            {"role": "assistant", "content": "tamam"},
        ]
    }
    inputs = tmp_path / "chats.jsonl"
    inputs.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n", encoding="utf-8")
    with pytest.raises(
        InputError, match=r"chats\.jsonl:2: messages\[0\] encodes to the special id 2 "
    ):
        build_corpus([inputs], tokenizer, tmp_path / "out", BuildOptions(seq_len=64))
    policy = RecordPolicy(invalid_records="drop")
    report = build_corpus(
        [inputs], tokenizer, tmp_path / "out", BuildOptions(seq_len=64, policy=policy)
    )
    assert report.sources[0].dropped == {"special_token_in_content": 1}
    specials = json.loads((tmp_path / "out" / "SPECIAL_TOKENS.json").read_text(encoding="utf-8"))
    # the tokenizer's own pad id is used; control ids follow its base vocabulary
    base = loaded.base_vocab_size
    assert (specials["pad_id"], specials["message_start_id"], specials["vocab_size"]) == (
        3,
        base,
        base + 2,
    )


def test_tokenizer_errors_name_the_file(tmp_path):
    with pytest.raises(TokenizerError, match=r"nope\.json: tokenizer file not found"):
        load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{}", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"bad\.json: not a loadable tokenizer\.json"):
        load_tokenizer(tmp_path / "bad.json")
    (tmp_path / "bad.model").write_bytes(b"\x00garbage")
    with pytest.raises(TokenizerError, match=r"bad\.model: not a loadable SentencePiece model"):
        load_tokenizer(tmp_path / "bad.model")


def test_tokenizer_without_eos_is_refused(tmp_path):
    tok = Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], unk_id=0, byte_fallback=False))
    tok.save(str(tmp_path / "noeos.json"))
    with pytest.raises(TokenizerError, match=r"noeos\.json: no end-of-sequence token"):
        load_tokenizer(tmp_path / "noeos.json")
