"""Misuse as a new user tries it: each mistake ends in a short, clear message, no traceback."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from nedolm.data.contract import CONTRACT_FILES

RunCli = Callable[..., subprocess.CompletedProcess[str]]  # the conftest's nedolm_sft fixture


def assert_clear_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 4, result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


def write_config(path: Path, **changes: object) -> Path:
    config = {
        "run_dir": "run",
        "base_config": "base/config.yaml",
        "base_run_dir": "base",
        "data_dir": "data",
        "optim": {"lr": 1e-3},
        "train": {"seq_len": 128, "num_workers": 0, "compile": False},
    }
    config.update(changes)
    path.write_text(yaml.safe_dump(config))
    return path


def test_run_with_a_missing_config_file(nedolm_sft: RunCli, tmp_path: Path) -> None:
    assert_clear_error(nedolm_sft("run", "nope.yaml", cwd=tmp_path), "nope.yaml")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--nproc-per-node", "2", "nope.yaml"], "nope.yaml: cannot read config"),
        (["--nproc-per-node", "2", "-m", "nope.yaml"], "drop -m/--no-python/--run-path"),
    ],
)
def test_launch_refuses_before_starting_any_rank(
    nedolm_sft: RunCli, tmp_path: Path, args: list[str], needle: str
) -> None:
    assert_clear_error(nedolm_sft("launch", *args, cwd=tmp_path), needle)


def test_run_with_a_typo_in_the_config_names_key_and_file(
    nedolm_sft: RunCli, tmp_path: Path
) -> None:
    config = write_config(tmp_path / "sft.yaml", train={"micro_bach_size": 2})
    assert_clear_error(nedolm_sft("run", str(config), cwd=tmp_path), "micro_bach_size", "sft.yaml")


def test_run_on_an_unprepared_data_directory(nedolm_sft: RunCli, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    base = nedolm_sft(
        *("init-base", "--preset", "tiny", "--vocab-size", "32003", "--eos-id", "2"),
        *("--out", str(tmp_path / "base")),
    )
    assert base.returncode == 0, base.stderr
    config = write_config(tmp_path / "sft.yaml")
    refused = nedolm_sft("run", str(config), cwd=tmp_path)
    assert_clear_error(refused, "SPECIAL_TOKENS.json", "run `nedolm-sft prepare` first")
    assert refused.returncode == 2 and not (tmp_path / "run").exists()
    for name in CONTRACT_FILES:  # looks prepared, is not: fails in the run, with a traceback
        (tmp_path / "data" / name).write_text("{}")
    loud = nedolm_sft("--debug", "run", str(config), cwd=tmp_path)
    assert loud.returncode != 0
    assert "Traceback" in loud.stderr


def test_export_of_an_empty_run_directory(nedolm_sft: RunCli, tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    result = nedolm_sft("export", "run", "--out", "hf", cwd=tmp_path)
    assert_clear_error(result, "run holds no checkpoint")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["generate", "missing-dir", "--prompt", "merhaba"], "missing-dir"),
        # no such device here: no CUDA on a CPU machine, no 1000th GPU on a GPU machine
        (["generate", "missing-dir", "--prompt", "merhaba", "--device", "cuda:999"], "cuda:999"),
        (["chat", "missing-dir", "--device", "gpu"], "--device gpu"),
        (["plot", "missing-run"], "missing-run"),
        (["verify", "not-a-corpus"], "not-a-corpus"),
        (["prepare", "missing.jsonl", "--tokenizer", "t.json", "--out", "d"], "t.json"),
    ],
)
def test_wrong_paths(nedolm_sft: RunCli, tmp_path: Path, args: list[str], needle: str) -> None:
    assert_clear_error(nedolm_sft(*args, cwd=tmp_path), needle)


def test_plot_names_a_corrupt_metrics_line(nedolm_sft: RunCli, tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{not json\n')
    assert_clear_error(nedolm_sft("plot", "run", cwd=tmp_path), "metrics.jsonl:2")
