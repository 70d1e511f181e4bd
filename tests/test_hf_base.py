"""SFT from a model saved by ``transformers``: import, fine-tune on real data, export, reload.

The base is a tiny random Llama (untied, GQA, llama3 rope scaling) saved by ``transformers``
next to the project's real Turkish tokenizer, as a Hugging Face model directory is laid out.
"""

from __future__ import annotations

import copy
import gzip
import json
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaForCausalLM

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.format import read_special_tokens
from nedolm.data.tokenizer import load_tokenizer
from nedolm.model import generate
from nedolm.train.base import import_hf_base
from nedolm.train.checkpoint import latest_checkpoint, load_checkpoint
from nedolm.train.hf_base import hf_base_config, load_hf_base
from nedolm.train.testing import save_tiny_hf_llama
from nedolm_sft.chat_model import load_chat_model

DEFAULT = files("nedolm_sft") / "default"
FIXTURES = Path(__file__).parents[1] / "packages" / "nedolm-data" / "tests" / "fixtures"
SEQ_LEN = 128  # the seq_len of conftest's sft_config
PROMPT = "Türkiye'nin başkenti neresidir?"
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
pytestmark = pytest.mark.slow  # real SFT runs and corpus builds in subprocesses
OTHER_TOKENIZER = FIXTURES / "tokenizer" / "mistral_v1.tokenizer.json.gz"


def nedolm_sft(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nedolm_sft", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = gzip.decompress(Path(str(DEFAULT / "tokenizer.json.gz")).read_bytes())
    return save_tiny_hf_llama(
        tmp_path_factory.mktemp("hf") / "tiny-llama",
        tokenizer,
        num_key_value_heads=1,
        rope_theta=500000.0,
        rope_scaling=copy.deepcopy(LLAMA3),
    )


def prepare(hf_dir_or_tokenizer: Path, out: Path, records: int = 160) -> Path:
    lines = Path(str(DEFAULT / "tr_chat_sample.jsonl")).read_text(encoding="utf-8").splitlines()
    sample = out.parent / f"{out.name}.jsonl"
    sample.write_text("\n".join(lines[:records]) + "\n", encoding="utf-8")
    build_corpus(
        [sample],
        hf_dir_or_tokenizer,
        out,
        BuildOptions(seq_len=SEQ_LEN, shards=4, val_shards=(3,)),
    )
    return out


@pytest.fixture(scope="module")
def corpus(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare(hf_dir, tmp_path_factory.mktemp("corpus") / "data")


@pytest.fixture(scope="module")
def trained(hf_dir, corpus, sft_config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sft")
    config = sft_config(root / "sft.yaml", corpus, base_hf_dir=str(hf_dir))
    result = nedolm_sft("run", str(config))
    assert result.returncode == 0, result.stderr
    return root / "run"


def test_prepare_takes_the_model_directory_and_its_eos(hf_dir: Path, corpus: Path) -> None:
    specials = read_special_tokens(corpus)
    tokenizer = load_tokenizer(hf_dir)
    assert specials.eos_id == tokenizer.eos_id == tokenizer.token_to_id("</s>")
    assert specials.message_start_id == tokenizer.base_vocab_size  # appended after the vocab
    assert sorted(p.name for p in (corpus / "tokenizer").iterdir()) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_sft_from_hf_export_reloads_in_transformers(trained: Path, tmp_path: Path) -> None:
    result = nedolm_sft("export", str(trained), "--out", str(tmp_path / "export"))
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["num_key_value_heads"] == 1
    ours = load_chat_model(trained).model.eval()
    assert ours.cfg.rope_scaling == LLAMA3 and not ours.cfg.tie_embeddings
    theirs = LlamaForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    ids = torch.randint(
        0, ours.cfg.vocab_size, (2, 100), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        diff = (ours(ids)[1] - theirs(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff

    chat = load_chat_model(tmp_path / "export")
    prompt = chat.render([("user", PROMPT)])
    got = list(generate(chat.model, prompt, max_new_tokens=24))
    want = theirs.generate(
        torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None
    )
    assert got == want[0, len(prompt) :].tolist()


def test_sft_started_from_the_imported_weights(hf_dir: Path, trained: Path) -> None:
    meta = load_checkpoint(latest_checkpoint(trained))
    assert meta["base_checkpoint"] == str(hf_dir)
    base = load_hf_base(hf_dir).state_dict()
    moved = [k for k in base if not torch.equal(base[k], meta["model"][k])]
    assert moved and set(meta["model"]) == set(base)  # same tensors, trained away from the base


@pytest.mark.parametrize("morph_expert_dim", [0, 16])
def test_import_hf_writes_a_base_run_of_the_grown_model(hf_dir, tmp_path, morph_expert_dim):
    result = nedolm_sft(
        "import-hf", str(hf_dir), "--out", str(tmp_path / "base"),
        "--morph-expert-dim", str(morph_expert_dim),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "base").iterdir()) == [
        "checkpoints",
        "config.yaml",
        "tokenizer",
    ]
    run_config = yaml.safe_load((tmp_path / "base" / "config.yaml").read_text())
    want_cfg, eos_id = hf_base_config(hf_dir, morph_expert_dim)
    assert run_config["model"] == json.loads(json.dumps(want_cfg.to_dict()))
    assert run_config["eos_id"] == eos_id and run_config["tokenizer"] == "tokenizer/tokenizer.json"
    state = load_checkpoint(latest_checkpoint(tmp_path / "base"))["model"]
    assert state["tok_embeddings.weight"].shape[0] == want_cfg.padded_vocab_size
    if morph_expert_dim:
        assert not state["blocks.0.morph.w_down"].any()
        assert state["morph_classes"].unique().tolist() == [0, 1, 2]

    again = nedolm_sft("import-hf", str(hf_dir), "--out", str(tmp_path / "base"))
    assert again.returncode != 0 and "already exists; choose a new --out" in again.stderr


def test_import_hf_bad_directory_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = nedolm_sft("import-hf", str(tmp_path / "empty"), "--out", str(tmp_path / "base"))
    assert result.returncode == 1
    assert result.stderr.strip() == f"Error: {tmp_path / 'empty' / 'config.json'}: missing"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_import_hf_without_tokenizer_is_refused(hf_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((hf_dir / name).read_bytes())
    with pytest.raises(Exception, match=r"bare/tokenizer\.json: tokenizer file not found"):
        import_hf_base(bare, tmp_path / "base")
    assert not (tmp_path / "base").exists()


def test_corpus_of_another_tokenizer_is_refused_at_run_start(hf_dir, tmp_path, sft_config):
    other = prepare(OTHER_TOKENIZER, tmp_path / "other", records=20)
    config = sft_config(tmp_path / "sft.yaml", other, base_hf_dir=str(hf_dir))
    result = nedolm_sft("run", str(config))
    assert result.returncode != 0
    line = next(x for x in result.stderr.splitlines() if "does not match" in x)
    assert f"corpus tokenizer {other / 'tokenizer' / OTHER_TOKENIZER.name}" in line
    assert f"base model's tokenizer {hf_dir / 'tokenizer.json'}" in line
    assert "vocabulary size 32000 != " in line or "EOS id" in line or "token " in line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_base_hf_dir_excludes_a_base_run(hf_dir, corpus, tmp_path, sft_config) -> None:
    config = sft_config(
        tmp_path / "sft.yaml", corpus, base_hf_dir=str(hf_dir), base_run_dir=str(tmp_path)
    )
    result = nedolm_sft("run", str(config))
    assert result.returncode == 2
    assert "base_hf_dir cannot be combined with base_config/base_run_dir/base_checkpoint" in (
        result.stderr
    )
