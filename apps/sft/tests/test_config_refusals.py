"""Config values a run cannot use are refused by ``nedolm-sft run`` before anything is written:
exit 2, one error line naming the key and what it allows, no run dir; and a data_dir of raw
chat files is told to run ``prepare`` first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from nedolm.train.testing import SMALL_BASE, init_tiny_base, write_sft_config
from nedolm_sft.cli import cli


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    out = tmp_path_factory.mktemp("base") / "base"
    return init_tiny_base(out, corpus, SMALL_BASE)


def write_config(path: Path, corpus: Path, base: Path) -> Path:
    """A runnable SFT YAML: one eager step, no validation; its run dir ``path`` without its
    suffix."""
    train = {"max_steps": 1, "num_workers": 0, "compile": False}
    return write_sft_config(path, corpus, base, train=train, validation={"enabled": False})


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error:")]


@pytest.mark.parametrize(
    ("optim", "train", "needle"),
    [
        ("lr: .nan", "", "optim.lr must be a finite number > 0, got nan"),
        ("lr: .inf", "", "optim.lr must be a finite number > 0, got inf"),
        ("grad_clip: .nan", "", "optim.grad_clip must be > 0 (.inf: no clipping), got nan"),
        ("eps: 0", "", "optim.eps must be a finite number > 0, got 0.0"),
        ("weight_decay: -0.5", "", "optim.weight_decay must be a finite number >= 0, got -0.5"),
        ("betas: [1.5, 0.95]", "", "optim.betas[0] must be in [0, 1), got 1.5"),
        ("betas: [0.9, -0.1]", "", "optim.betas[1] must be in [0, 1), got -0.1"),
        ("", "prefetch_factor: 0", "train.prefetch_factor must be >= 1, got 0"),
        ("", "max_hours: .nan", "train.max_hours must be >= 0 (0: off), got nan"),
    ],
)
def test_a_value_out_of_range_is_refused_before_the_run_dir_exists(
    tmp_path: Path, corpus: Path, base: Path, optim: str, train: str, needle: str
) -> None:
    config = write_config(tmp_path / "run.yaml", corpus, base)
    doc = yaml.safe_load(config.read_text(encoding="utf-8"))
    doc["optim"] = yaml.safe_load(f"{{{optim}}}")
    doc["train"].update(yaml.safe_load(f"{{{train}}}"))
    config.write_text(yaml.safe_dump(doc), encoding="utf-8")
    result = CliRunner().invoke(cli, ["run", str(config)])
    assert result.exit_code == 2, result.output
    [line] = error_lines(result.output)
    assert line == f"Error: {config}: {needle}"
    assert not (tmp_path / "run").exists()


def test_prefetch_factor_0_is_one_line_in_a_real_process(
    tmp_path: Path, corpus: Path, base: Path
) -> None:
    """Was a 48-line AssertionError from torch's DataLoader, after the run dir was written."""
    config = write_config(tmp_path / "run.yaml", corpus, base)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nedolm_sft",
            "run",
            str(config),
            "--set",
            "train.prefetch_factor=0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    [line] = error_lines(result.stderr)
    assert line.endswith("train.prefetch_factor must be >= 1, got 0")
    assert not (tmp_path / "run").exists()


def test_a_data_dir_of_raw_chat_files_says_run_prepare_first(
    tmp_path: Path, corpus: Path, base: Path
) -> None:
    raw = tmp_path / "chats"
    raw.mkdir()
    (raw / "train.jsonl").write_text('{"messages": []}\n', encoding="utf-8")
    config = write_config(tmp_path / "run.yaml", raw, base)
    result = CliRunner().invoke(cli, ["run", str(config)])
    assert result.exit_code == 2, result.output
    [line] = error_lines(result.output)
    assert f"data_dir {raw} holds chat files (train.jsonl), not a prepared corpus" in line
    assert "run `nedolm-sft prepare` first" in line
    assert not (tmp_path / "run").exists()
