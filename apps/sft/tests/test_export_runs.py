"""``nedolm-sft export`` / ``generate`` of every run directory the app writes, read back by
transformers: a morph SFT run (loader code shipped, ``trust_remote_code``), an ``init-base``
run and an ``import-hf`` run. Everything is local (no hub access) and runs as real processes."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaForCausalLM,
    pipeline,
)

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.model import generate
from nedolm.train.testing import save_tiny_hf_llama, write_sft_config
from nedolm_sft.chat_model import load_chat_model

FIXTURES = Path(__file__).resolve().parents[3] / "packages" / "nedolm-data" / "tests" / "fixtures"
DEFAULT = files("nedolm_sft") / "default"
PROMPT = "Türkiye'nin başkenti neresidir?"
MORPH_TINY = [
    "d_model=64",
    "n_layers=2",
    "n_heads=4",
    "n_kv_heads=2",
    "ffn_dim=96",
    "morph_expert_dim=16",
    "max_seq_len=256",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
pytestmark = pytest.mark.slow  # real SFT runs and exports in subprocesses


def cli(*args: object) -> str:
    """``nedolm-sft ARGS`` in a real process; its stdout (the test fails on a non-zero exit)."""
    result = cli_result(*args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def cli_result(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nedolm_sft", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )


def remote(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, dtype=torch.float32
    ).eval()


def random_ids(vocab_size: int, shape: tuple[int, int]) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped sample prepared with the shipped Turkish tokenizer (byte-level BPE, whose
    whole-text encoding equals the renderer's per-message encoding, so the exported chat
    template gives the training ids)."""
    root = tmp_path_factory.mktemp("corpus")
    lines = Path(str(DEFAULT / "tr_chat_sample.jsonl")).read_text(encoding="utf-8").splitlines()
    (root / "sample.jsonl").write_text("\n".join(lines[:120]) + "\n", encoding="utf-8")
    tokenizer = Path(str(DEFAULT / "tokenizer.json.gz"))
    build_corpus([root / "sample.jsonl"], tokenizer, root / "data", BuildOptions(seq_len=256))
    return root / "data"


@pytest.fixture(scope="module")
def morph_base(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random morph base (tiny preset, classes from the corpus tokenizer) by ``init-base``."""
    base = tmp_path_factory.mktemp("morph") / "base"
    sets = [arg for item in MORPH_TINY for arg in ("--set", item)]
    cli("init-base", "--preset", "tiny", "--data-dir", corpus, "--out", base, *sets)
    return base


def fine_tune(base: Path, data_dir: Path, run_dir: Path) -> Path:
    """``run_dir``: the base run ``base`` fine-tuned on ``data_dir`` for 3 steps by ``nedolm-sft
    run`` (its YAML beside the run directory)."""
    path = write_sft_config(
        run_dir.with_suffix(".yaml"),
        data_dir,
        base,
        optim={"lr": 3e-3, "warmup_steps": 1},
        train={
            "seq_len": 256,
            "micro_batch_size": 1,
            "grad_accum_steps": 1,
            "max_steps": 3,
            "num_workers": 0,
            "compile": False,
        },
        validation={"enabled": False},
    )
    cli("run", path)
    return run_dir


@pytest.fixture(scope="module")
def morph_run(morph_base: Path, corpus: Path) -> Path:
    return fine_tune(morph_base, corpus, morph_base.parent / "run")


@pytest.fixture(scope="module")
def morph_export(morph_run: Path) -> Path:
    out = morph_run.parent / "export"
    cli("export", morph_run, "--out", out)
    return out


def test_morph_export_loads_in_transformers_with_our_logits(morph_run, morph_export) -> None:
    names = {p.name for p in morph_export.iterdir()}
    assert {"configuration_nedolm.py", "modeling_nedolm.py", "tokenizer.json"} <= names
    config = json.loads((morph_export / "config.json").read_text())
    assert config["architectures"] == ["NedoLMForCausalLM"] and config["num_morph_classes"] == 3
    ours = load_chat_model(morph_run).model
    theirs = remote(morph_export)
    ids = random_ids(ours.cfg.vocab_size, (2, 64))
    with torch.no_grad():
        diff = (ours(ids)[1] - theirs(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff


def test_transformers_generate_with_the_shipped_template_equals_nedolm_sft_generate(
    morph_run, morph_export
) -> None:
    chat = load_chat_model(morph_export)
    tokenizer = AutoTokenizer.from_pretrained(morph_export, trust_remote_code=True)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert prompt == chat.render([("user", PROMPT)])
    theirs = remote(morph_export)
    # 24 tokens, stop ids ignored: every step of the cache is compared.
    raw = theirs.generate(
        torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    assert raw[0, len(prompt) :].tolist() == list(generate(chat.model, prompt, max_new_tokens=24))

    # With the shipped generation_config.json (stops at <|mesaj_bitir|> or EOS), as a user runs it.
    out = theirs.generate(
        torch.tensor([prompt]), max_new_tokens=24, pad_token_id=tokenizer.pad_token_id
    )
    reply = tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True)
    assert reply.strip()
    chat_pipeline = pipeline("text-generation", model=theirs, tokenizer=tokenizer)
    answer = chat_pipeline([{"role": "user", "content": PROMPT}], max_new_tokens=24)
    assert answer[0]["generated_text"][-1] == {"role": "assistant", "content": reply}
    for source in (morph_export, morph_run):
        text = cli("generate", source, "--prompt", PROMPT, "--max-new-tokens", 24)
        assert text.strip() == reply.strip(), source


def test_save_pretrained_of_the_loaded_model_round_trips(morph_export, tmp_path) -> None:
    theirs = remote(morph_export)
    theirs.save_pretrained(tmp_path / "saved")
    assert {"configuration_nedolm.py", "modeling_nedolm.py"} <= {
        p.name for p in (tmp_path / "saved").iterdir()
    }
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_nedolm.NedoLMForCausalLM"
    again = remote(tmp_path / "saved")
    ids = random_ids(theirs.config.vocab_size, (2, 40))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, theirs(ids).logits)


def test_morph_export_imports_back_as_a_morph_base(morph_run, morph_export, tmp_path) -> None:
    """import-hf reads a morph export (experts and classes included): SFT can start from it."""
    cli("import-hf", morph_export, "--out", tmp_path / "base")
    base = load_chat_model(tmp_path / "base").model
    ours = load_chat_model(morph_run).model
    assert base.cfg.n_morph_classes == 3
    assert torch.equal(base.morph_classes, ours.morph_classes)
    ids = random_ids(ours.cfg.vocab_size, (2, 40))
    with torch.no_grad():
        assert torch.equal(base(ids)[1], ours(ids)[1])


def test_data_dir_is_refused_for_runs_that_bring_their_tokenizer(
    morph_run, morph_export, corpus
) -> None:
    for source in (morph_run, morph_export):
        result = cli_result("generate", source, "--data-dir", corpus, "--prompt", PROMPT)
        assert result.returncode == 2, result.stderr
        assert "--data-dir is for base runs" in result.stderr


def test_init_base_run_exports_and_generates(morph_base, corpus, tmp_path) -> None:
    refused = cli_result("export", morph_base, "--out", tmp_path / "x")
    assert refused.returncode != 0 and "names no tokenizer" in refused.stderr
    assert "--data-dir" in refused.stderr and not (tmp_path / "x").exists()

    cli("export", morph_base, "--data-dir", corpus, "--out", tmp_path / "export")
    ours = load_chat_model(morph_base, corpus).model
    ids = random_ids(ours.cfg.vocab_size, (2, 48))
    with torch.no_grad():
        diff = (ours(ids)[1] - remote(tmp_path / "export")(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff
    args = ("--prompt", PROMPT, "--max-new-tokens", 12)
    from_run = cli("generate", morph_base, "--data-dir", corpus, *args)
    assert from_run.strip() and from_run == cli("generate", tmp_path / "export", *args)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama saved by transformers beside a real tokenizer, as on the hub."""
    tokenizer = gzip.decompress(
        (FIXTURES / "tokenizer" / "mistral_v1.tokenizer.json.gz").read_bytes()
    )
    return save_tiny_hf_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", tokenizer)


@pytest.mark.parametrize("morph_expert_dim", [0, 16])
def test_import_hf_base_exports_the_original_logits(hf_llama, tmp_path, morph_expert_dim) -> None:
    base = tmp_path / "base"
    cli("import-hf", hf_llama, "--out", base, "--morph-expert-dim", morph_expert_dim)
    cli("export", base, "--out", tmp_path / "export")
    original = LlamaForCausalLM.from_pretrained(hf_llama, dtype=torch.float32).eval()
    if morph_expert_dim:
        exported = remote(tmp_path / "export")  # zero-output experts: still the original's logits
    else:
        exported = LlamaForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    vocab = original.config.vocab_size
    assert exported.config.vocab_size > vocab  # grown for the control and pad ids
    ids = random_ids(vocab, (2, 48))
    with torch.no_grad():
        want = original(ids).logits
        diff = (exported.eval()(ids).logits[..., :vocab] - want).abs().max().item()
    assert diff <= 1e-5, diff
    args = ("--prompt", PROMPT, "--max-new-tokens", 12)
    from_run = cli("generate", base, *args)
    assert from_run.strip() and from_run == cli("generate", tmp_path / "export", *args)


def test_a_fine_tuned_model_is_fine_tuned_again_twice(corpus: Path, tmp_path: Path) -> None:
    """export → import-hf → prepare --tokenizer EXPORT → run → export, twice: the exported
    tokenizer already holds the control tokens, and keeps them at the corpus's ids."""
    sets = [arg for item in [*MORPH_TINY, "n_morph_classes=0", "morph_expert_dim=0"]
            for arg in ("--set", item)]  # fmt: skip
    cli("init-base", "--preset", "tiny", "--data-dir", corpus, "--out", tmp_path / "base0", *sets)
    export = tmp_path / "export0"
    cli("export", fine_tune(tmp_path / "base0", corpus, tmp_path / "run0"), "--out", export)
    want = json.loads((corpus / "SPECIAL_TOKENS.json").read_text())
    vocab_size = json.loads((export / "config.json").read_text())["vocab_size"]
    for n in (1, 2):
        cli("import-hf", export, "--out", tmp_path / f"base{n}")
        data = tmp_path / f"data{n}"
        cli("prepare", corpus.parent / "sample.jsonl", "--tokenizer", export, "--out", data,
            "--seq-len", 256, "--shards", 2, "--no-progress")  # fmt: skip
        got = json.loads((data / "SPECIAL_TOKENS.json").read_text())
        keys = ("eos_id", "pad_id", "message_start_id", "message_end_id", "vocab_size")
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, n
        run = fine_tune(tmp_path / f"base{n}", data, tmp_path / f"run{n}")
        export = tmp_path / f"export{n}"
        cli("export", run, "--out", export)
        assert json.loads((export / "config.json").read_text())["vocab_size"] == vocab_size
        tokenizer = AutoTokenizer.from_pretrained(export)
        assert len(tokenizer) == vocab_size
        assert tokenizer.encode("<|mesaj_basla|><|mesaj_bitir|>", add_special_tokens=False) == [
            want["message_start_id"],
            want["message_end_id"],
        ]
        ours = load_chat_model(run).model
        theirs = LlamaForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
        tokens = random_ids(vocab_size, (2, 48))
        with torch.no_grad():
            diff = (ours(tokens)[1] - theirs(tokens).logits).abs().max().item()
        assert diff <= 1e-4, (n, diff)
