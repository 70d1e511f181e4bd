"""``nedolm-sft init-base`` and ``nedolm-sft run`` end to end, as real processes."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from nedolm.data.tokenizer import load_tokenizer
from nedolm.model import morph_classes_from_vocab
from nedolm.train.checkpoint import latest_checkpoint, load_checkpoint
from nedolm.train.config import load_run_config
from nedolm.train.testing import CLI_ENV, SMALL_BASE, set_options
from nedolm_sft.cli import cli

RunCli = Callable[..., subprocess.CompletedProcess[str]]  # the conftest's nedolm_sft fixture


def test_init_base_then_run_a_smoke_fine_tune(
    nedolm_sft: RunCli, corpus: Path, tmp_path: Path
) -> None:
    base = tmp_path / "base"
    sets = set_options({**SMALL_BASE, "max_seq_len": 256})
    result = nedolm_sft(
        "init-base",
        *("--preset", "tiny", "--data-dir", str(corpus), "--out", str(base), *sets),
        env=CLI_ENV,
    )
    assert result.returncode == 0, result.stderr
    run_config = load_run_config(base / "config.yaml")
    special = json.loads((corpus / "SPECIAL_TOKENS.json").read_text(encoding="utf-8"))
    assert run_config.model["vocab_size"] == special["vocab_size"]
    assert run_config.eos_id == special["eos_id"] and run_config.model["d_model"] == 64
    pieces = load_tokenizer(corpus / special["tokenizer"]["file"]).pieces()
    classes = load_checkpoint(latest_checkpoint(base))["model"]["morph_classes"]
    assert torch.equal(classes[: len(pieces)], morph_classes_from_vocab(pieces))
    assert len(set(classes.tolist())) == 3  # word-initial, continuation and other pieces

    config = tmp_path / "sft.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run_dir": "run",
                "base_config": "base/config.yaml",
                "base_run_dir": "base",
                "data_dir": str(corpus),
                "optim": {"lr": 1e-3, "warmup_steps": 1},
                "train": {
                    "seq_len": 256,
                    "micro_batch_size": 1,
                    "grad_accum_steps": 1,
                    "num_workers": 0,
                },
                "validation": {"enabled": False},
            }
        ),
        encoding="utf-8",
    )
    result = nedolm_sft("run", str(config), "--smoke-steps", "2", "--no-compile", env=CLI_ENV)
    assert result.returncode == 0, result.stderr
    state = load_checkpoint(latest_checkpoint(tmp_path / "run.smoke"))
    assert state["step"] == 2 and state["contract"]["execution"]["effective_compile"] is False
    assert "step 2/2 epoch " in result.stderr
    assert not (tmp_path / "run").exists()  # the smoke run leaves the real run dir alone

    # A second smoke run starts afresh in its scratch dir (it does not resume the first).
    result = nedolm_sft("run", str(config), "--smoke-steps", "1", "--no-compile", env=CLI_ENV)
    assert result.returncode == 0, result.stderr
    assert [p.name for p in (tmp_path / "run.smoke" / "checkpoints").glob("step-*.pt")] == [
        "step-00000001.pt"
    ]

    # The real run then starts cleanly, from step 0, with its own max_steps (set on the line).
    real = ("run", str(config), "--no-compile", "--set", "train.max_steps=3")
    result = nedolm_sft(*real, env=CLI_ENV)
    assert result.returncode == 0, result.stderr
    assert "step 3/3 epoch " in result.stderr and "resuming" not in result.stderr
    assert load_checkpoint(latest_checkpoint(tmp_path / "run"))["step"] == 3

    # A single process's refusal is one line, without the "rank 0: ResumeRefused:" frame.
    result = nedolm_sft(*real, "--set", "optim.lr=0.5", env=CLI_ENV)
    assert result.returncode == 1
    assert "error: load SFT checkpoint failed: refusing to resume from " in result.stderr
    assert "training.recipe.optim.lr: checkpoint 0.001 != now 0.5" in result.stderr
    assert "rank 0" not in result.stderr.splitlines()[-2], result.stderr


def test_print_config_resolves_overrides_and_leaves_the_run_dir_untouched(
    nedolm_sft: RunCli, tmp_path: Path
) -> None:
    config = minimal_config(tmp_path)
    args = ("--set", "optim.lr=1e-4", "--set", "validation.shard_ids=[3]", "--print-config")
    for command in (("run", str(config)), ("launch", "--nproc-per-node", "2", str(config))):
        result = nedolm_sft(*command, *args, env=CLI_ENV)
        assert result.returncode == 0, result.stderr
        printed = yaml.safe_load(result.stdout)
        assert printed["optim"]["lr"] == 1e-4 and printed["validation"]["shard_ids"] == [3]
        assert printed["run_dir"] == str(tmp_path / "run")
        assert printed["train"]["max_steps"] == 0  # every default is filled in
        # What is printed is a config: it loads back to the same values.
        again = tmp_path / "printed.yaml"
        again.write_text(result.stdout, encoding="utf-8")
        assert (
            yaml.safe_load(nedolm_sft("run", str(again), "--print-config", env=CLI_ENV).stdout)
            == printed
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["printed.yaml", "sft.yaml"]


@pytest.mark.parametrize("command", ["run", "launch"])
def test_an_unknown_override_is_refused_before_anything_starts(
    nedolm_sft: RunCli, tmp_path: Path, command: str
) -> None:
    config = minimal_config(tmp_path)
    result = nedolm_sft(command, str(config), "--set", "train.max_stesp=3", env=CLI_ENV)
    assert result.returncode == 2
    assert "unknown key `max_stesp` in `train`; did you mean `max_steps`?" in result.stderr
    assert not (tmp_path / "run").exists()


def minimal_config(directory: Path) -> Path:
    """An SFT YAML of the three required keys, naming a corpus and a model that do not exist."""
    config = directory / "sft.yaml"
    config.write_text("run_dir: run\nbase_hf_dir: hf\ndata_dir: corpus\n", encoding="utf-8")
    return config


SIZED_TINY = ["--preset", "tiny", "--out", "b", "--vocab-size", "100", "--eos-id", "2"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--preset", "tiny", "--out", "b"], "exactly one of --vocab-size or --data-dir"),
        (["--preset", "tiny", "--out", "b", "--vocab-size", "100"], "--vocab-size needs --eos-id"),
        (["--preset", "huge", "--out", "b", "--vocab-size", "100"], "'huge' is not one of"),
        ([*SIZED_TINY, "--set", "d_modle=8"], "d_modle"),
        ([*SIZED_TINY, "--set", "oops"], "expected KEY=VALUE"),
    ],
)
def test_init_base_usage_errors_name_the_problem(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(cli, ["init-base", *args])
    assert result.exit_code != 0
    assert needle in result.output or needle in str(result.exception)


@pytest.mark.parametrize("command", ["run", "launch"])
def test_a_missing_corpus_is_named_and_leaves_no_run_dir(
    nedolm_sft: RunCli, tmp_path: Path, command: str
) -> None:
    config = minimal_config(tmp_path)
    result = nedolm_sft(command, str(config), env=CLI_ENV)
    assert result.returncode == 2
    assert f"data_dir {tmp_path / 'corpus'} does not exist" in result.stderr
    assert "SPECIAL_TOKENS" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_run_dir_inside_the_corpus_is_refused(
    nedolm_sft: RunCli, corpus: Path, tmp_path: Path
) -> None:
    config = tmp_path / "sft.yaml"
    run_dir = corpus / "runs" / "sft"
    config.write_text(
        yaml.safe_dump({"run_dir": str(run_dir), "base_hf_dir": "hf", "data_dir": str(corpus)}),
        encoding="utf-8",
    )
    result = nedolm_sft("run", str(config), env=CLI_ENV)
    assert result.returncode == 2
    assert f"run_dir {run_dir} is inside the corpus data_dir {corpus}" in result.stderr
    assert not (corpus / "runs").exists()
