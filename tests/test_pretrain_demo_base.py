"""tools/pretrain_demo_base.py: the shipped demo base is what its recipe says, and the tool works.

The shipped base is loaded through the normal base-run path (``read_base_weights``) and scored on the held-out slice stored beside it; the figure must match
the one RECIPE.md records. The tool itself runs for a couple of steps on the data package's
small copy of the chat files, in a real process, and must leave a complete base or nothing.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
from importlib.resources import files
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from nedolm.data.tokenizer import build_special_tokens, load_tokenizer
from nedolm.model import MorphTransformer, build_model
from nedolm.train.base import model_config
from nedolm.train.base_weights import read_base_weights
from nedolm.train.config import load_run_config

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "pretrain_demo_base.py"
DEFAULT = Path(str(files("nedolm_sft") / "default"))
CHAT_FIXTURES = ROOT / "packages" / "nedolm-data" / "tests" / "fixtures" / "tr_chat"
BASE_FILES = ["RECIPE.md", "config.yaml", "heldout.txt.gz", "model.safetensors", "pretraining.json"]
SMALL = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1"]
SMALL += ["--ffn-dim", "64", "--seq-len", "64", "--batch-rows", "2", "--heldout-every", "4"]


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pretrain_demo_base", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load_base(base_dir: Path) -> MorphTransformer:
    """The way SFT loads a base run: its config, then its newest weights."""
    model = build_model(model_config(load_run_config(base_dir / "config.yaml")))
    model.load_state_dict(read_base_weights(base_dir)[1])
    return model


def recorded_recipe(tool: ModuleType, base_dir: Path) -> Any:
    """The recipe RECIPE.md's command line stands for."""
    text = (base_dir / "RECIPE.md").read_text(encoding="utf-8")
    command = shlex.split(text.split("```\n", 1)[1].split("\n", 1)[0])
    assert command[:2] == ["python", "tools/pretrain_demo_base.py"], command
    args = tool.parse_args(command[2:])
    return tool.Recipe(**{name: getattr(args, name) for name in tool.Recipe.__annotations__})


def reproduced_heldout_loss(tool: ModuleType, base_dir: Path) -> tuple[float, float]:
    """(loss recorded in RECIPE.md, loss of the stored weights on the stored held-out slice)."""
    recipe = recorded_recipe(tool, base_dir)
    run_config = load_run_config(base_dir / "config.yaml")
    docs = tool.encode_documents(DEFAULT / "tokenizer.json.gz", tool.read_heldout_text(base_dir))
    rows = tool.heldout_rows(docs, recipe.seq_len + 1)
    measured = tool.heldout_loss(load_base(base_dir), rows, run_config.eos_id)
    recorded = tool.read_recipe_loss((base_dir / "RECIPE.md").read_text(encoding="utf-8"))
    return recorded, measured


def test_the_shipped_base_reproduces_its_recorded_heldout_loss(tool: ModuleType) -> None:
    base_dir = DEFAULT / "base"
    assert sorted(p.name for p in base_dir.iterdir()) == BASE_FILES
    assert (base_dir / "model.safetensors").stat().st_size <= 25 * 1024 * 1024
    recorded, measured = reproduced_heldout_loss(tool, base_dir)
    assert measured == pytest.approx(recorded, abs=1e-3)
    assert measured <= 5.5, "issue 20's goal: past a smoothed bigram's ~5.9 nats on this slice"
    recipe = recorded_recipe(tool, base_dir)
    shown = json.loads((base_dir / "pretraining.json").read_text())  # what the demo prints
    assert shown["heldout_loss"] == pytest.approx(recorded, abs=1e-4)
    steps = recipe.stop_step or recipe.steps
    assert shown["tokens_seen"] == steps * recipe.batch_rows * recipe.seq_len


def test_the_shipped_base_uses_the_corpus_ids(tool: ModuleType) -> None:
    tokenizer_path = DEFAULT / "tokenizer.json.gz"
    specials = build_special_tokens(load_tokenizer(tokenizer_path), tokenizer_path.name)
    run_config = load_run_config(DEFAULT / "base" / "config.yaml")
    cfg = model_config(run_config)
    assert (cfg.vocab_size, run_config.eos_id) == (specials.vocab_size, specials.eos_id)
    assert (specials.message_start_id, specials.message_end_id) == (32000, 32001)
    assert cfg.padded_vocab_size % 64 == 0 and cfg.n_morph_classes == 0


def test_demo_conversations_never_reach_pretraining(tool: ModuleType, tmp_path: Path) -> None:
    sample = [json.loads(line) for line in (DEFAULT / "tr_chat_sample.jsonl").open()]
    prompts = [json.loads(line) for line in (DEFAULT / "heldout_prompts.jsonl").open()]
    held = next(r for r in sample if r["id"] == prompts[0]["id"])
    seed_task = next(r for r in sample if r["source"] == "seed_tasks_tr")
    alpaca = {
        "instruction": seed_task["messages"][0]["content"],
        "input": "",
        "output": seed_task["messages"][1]["content"],
    }
    novel = {
        "messages": [
            {"role": "user", "content": "Ankara hangi bölgededir?"},
            {"role": "assistant", "content": "Ankara İç Anadolu Bölgesi'ndedir."},
        ]
    }
    data = tmp_path / "tr_chat"
    data.mkdir()
    lines = [json.dumps(r, ensure_ascii=False) for r in (held, alpaca, novel)]
    (data / "chat.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    documents = tool.pretraining_documents(data, DEFAULT / "tr_chat_sample.jsonl")
    assert documents == ["Ankara hangi bölgededir?\nAnkara İç Anadolu Bölgesi'ndedir."]


@pytest.mark.slow
def test_the_tool_writes_a_loadable_base_in_place(tool: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "base"
    out.mkdir()
    (out / "stale.txt").write_text("from an older run")
    args = ["--data-dir", str(CHAT_FIXTURES), "--out", str(out), "--steps", "2", *SMALL]
    args += ["--tie-embeddings", "false", "--precision", "bfloat16"]  # as the shipped base
    result = subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]

    assert sorted(p.name for p in out.iterdir()) == BASE_FILES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]  # no temporary left over
    recorded, measured = reproduced_heldout_loss(tool, out)
    assert measured == pytest.approx(recorded, abs=1e-4)  # RECIPE.md has 4 decimals
    progress = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [p["step"] for p in progress if "heldout_loss" in p] == [0, 2]
    assert not model_config(load_run_config(out / "config.yaml")).tie_embeddings
    assert "own output head" in (out / "RECIPE.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("flags", [["--precision", "fp16"], ["--tie-embeddings", "no"]])
def test_the_tool_refuses_unknown_option_values(
    tool: ModuleType, tmp_path: Path, flags: list[str]
) -> None:
    args = ["--data-dir", str(CHAT_FIXTURES), "--out", str(tmp_path / "base"), *SMALL, *flags]
    with pytest.raises(SystemExit):
        tool.pretrain(tool.parse_args(args), args)
    assert not (tmp_path / "base").exists()


def test_a_failed_write_keeps_the_previous_base(
    tool: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "base"
    out.mkdir()
    (out / "config.yaml").write_text("the previous base\n")

    def disk_full(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tool, "save_file", disk_full)
    model = tool.build_model(tool.dense_model_config(tool.Recipe(d_model=32, n_heads=2), 300))
    with pytest.raises(OSError, match="No space left"):
        tool.write_base(out, model, 2, ["metin"], "# recipe\n")
    assert [p.name for p in tmp_path.iterdir()] == ["base"]
    assert [p.name for p in out.iterdir()] == ["config.yaml"]
    assert (out / "config.yaml").read_text() == "the previous base\n"
