"""An export other tools read without friction: config.json names the shipped tokenizer's ids,
and ``AutoTokenizer.from_pretrained(export)`` of a morph export loads like a Llama's, without a
trust_remote_code prompt or a model-type warning (checked in a fresh process, stdin closed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from nedolm.train.testing import init_tiny_base
from nedolm_sft.chat_model import load_chat_model
from nedolm_sft.cli import cli

TEXT = "Merhaba! Türkiye'nin başkenti neresidir?\n  Ankara'dır; 1923'ten beri."
DENSE = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96,
         "n_morph_classes": 0, "morph_expert_dim": 0, "max_seq_len": 256}  # fmt: skip
KINDS = {"dense": DENSE, "morph": {**DENSE, "n_morph_classes": 3, "morph_expert_dim": 16}}
PROBE = """
import json, sys
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
open(sys.argv[3], "w").write(json.dumps({
    "eos_token_id": tokenizer.eos_token_id,
    "bos_token_id": tokenizer.bos_token_id,
    "pad_token_id": tokenizer.pad_token_id,
    "ids": tokenizer.encode(sys.argv[2], add_special_tokens=False),
}))
"""
# What transformers prints when it would run an export's own code, or reads a config it lacks.
FRICTION = ("[y/N]", "trust_remote_code", "custom code", "model of type")


@pytest.fixture(scope="module", params=sorted(KINDS))
def export(
    request: pytest.FixtureRequest, sample_corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """``nedolm-sft export`` of a random base run of the sample corpus (dense or morph)."""
    root = tmp_path_factory.mktemp(request.param)
    init_tiny_base(root / "base", sample_corpus, KINDS[request.param])
    args = ["export", root / "base", "--data-dir", sample_corpus, "--out", root / "export"]
    result = CliRunner().invoke(cli, [str(arg) for arg in args])
    assert result.exit_code == 0, result.output
    return root / "export"


@pytest.fixture(scope="module")
def probed(export: Path) -> tuple[dict, str]:
    """What a fresh ``AutoTokenizer.from_pretrained(export)`` gives (stdin closed, no hub), and
    all it printed."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    answer = export.with_name("auto_tokenizer.json")
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(export), TEXT, str(answer)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,  # a prompt waiting on a terminal would hang here
        env=env,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(answer.read_text(encoding="utf-8")), done.stdout + done.stderr


def test_auto_tokenizer_loads_without_a_prompt_or_warning(export: Path, probed) -> None:
    theirs, output = probed
    assert not [sign for sign in FRICTION if sign in output], output
    [ours] = load_chat_model(export).tokenizer.encode_batch([TEXT])
    assert theirs["ids"] == ours
    assert len(ours) > 10


def test_config_json_names_the_tokenizers_ids(export: Path, sample_corpus: Path, probed) -> None:
    theirs, _ = probed
    config = json.loads((export / "config.json").read_text(encoding="utf-8"))
    keys = ("eos_token_id", "bos_token_id", "pad_token_id")
    assert {k: config[k] for k in keys} == {k: theirs[k] for k in keys}
    specials = json.loads((sample_corpus / "SPECIAL_TOKENS.json").read_text(encoding="utf-8"))
    assert (config["eos_token_id"], config["pad_token_id"]) == (
        specials["eos_id"],
        specials["pad_id"],
    )
    assert config["bos_token_id"] is None  # trained without BOS: the tokenizer adds none
