"""A Hugging Face model directory as the tokenizer: EOS from its config, control ids kept."""

from __future__ import annotations

import gzip
import json

import pytest
from tokenizers import AddedToken, Tokenizer

from nedolm.data.records import MESSAGE_END_TOKEN, MESSAGE_START_TOKEN
from nedolm.data.tokenizer import TokenizerError, build_special_tokens, load_tokenizer


@pytest.fixture
def model_dir(tmp_path, tokenizer_json):
    (tmp_path / "tokenizer.json").write_bytes(gzip.decompress(tokenizer_json.read_bytes()))
    return tmp_path


def test_eos_comes_from_tokenizer_config(model_dir):
    assert load_tokenizer(model_dir).eos_id == 2  # "</s>" by name, without a config
    config = {"eos_token": {"content": "<s>", "special": True}}  # the AddedToken form
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.eos_id == 1 and tokenizer.config_path == model_dir / "tokenizer_config.json"
    assert build_special_tokens(tokenizer, "tokenizer/tokenizer.json").eos_id == 1


def test_eos_token_missing_from_the_vocabulary_is_named(model_dir):
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot|>"}))
    with pytest.raises(
        TokenizerError, match=r"tokenizer_config\.json: eos_token '<\|eot\|>' is not in the vocab"
    ):
        load_tokenizer(model_dir)


def test_directory_without_tokenizer_json_is_named(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: tokenizer file not found"):
        load_tokenizer(tmp_path)


def test_control_tokens_the_tokenizer_already_has_keep_their_ids(model_dir):
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(MESSAGE_END_TOKEN), AddedToken(MESSAGE_START_TOKEN)])
    tok.save(str(model_dir / "tokenizer.json"))
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.base_vocab_size == 32002
    specials = build_special_tokens(tokenizer, "tokenizer/tokenizer.json")
    assert (specials.message_end_id, specials.message_start_id) == (32000, 32001)
    assert specials.pad_id == 32002 and specials.vocab_size == 32003


def test_sentencepiece_token_lookup(sentencepiece_model):
    tokenizer = load_tokenizer(sentencepiece_model)
    assert tokenizer.token_to_id("</s>") == 2
    assert tokenizer.token_to_id(MESSAGE_START_TOKEN) is None
    specials = build_special_tokens(tokenizer, "tokenizer/x.model")
    assert (specials.message_start_id, specials.message_end_id, specials.pad_id) == (
        32000,
        32001,
        32002,
    )
