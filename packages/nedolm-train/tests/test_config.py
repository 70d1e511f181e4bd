"""Strict config loading: unknown/mistyped keys name key and file; examples document defaults."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import yaml

from nedolm.model import ModelConfig
from nedolm.train.base import model_config
from nedolm.train.config import (
    ConfigError,
    OptimConfig,
    SFTConfig,
    TrainConfig,
    ValidationConfig,
    load_run_config,
    load_sft_config,
)

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
MINIMAL = "run_dir: r\nbase_config: b.yaml\nbase_run_dir: br\ndata_dir: d\noptim: {}\ntrain: {}\n"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sft.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_relative_paths_resolve_against_the_yaml_dir(tmp_path: Path) -> None:
    cfg = load_sft_config(_write(tmp_path, MINIMAL + "base_checkpoint: ck/step.pt\n"))
    assert cfg.run_dir == tmp_path / "r" and cfg.data_dir == tmp_path / "d"
    assert cfg.base_checkpoint == tmp_path / "ck" / "step.pt"
    assert cfg.train == TrainConfig() and cfg.validation == ValidationConfig()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (MINIMAL.replace("train: {}", "train: {micro_batch: 4}"), "unknown field `micro_batch`"),
        (MINIMAL.replace("train: {}", "train: {seq_len: long}"), "$.train.seq_len"),
        (MINIMAL.replace("optim: {}", "optim: {schedule: step}"), "$.optim.schedule"),
        (MINIMAL.replace("optim: {}", "optim: {lr: 0}"), "lr must be > 0"),
        (MINIMAL.replace("train: {}", "train: {keep_last: 0}"), "keep_last must be >= 1"),
        (MINIMAL + "validatoin: {}\n", "unknown field `validatoin`"),
        (MINIMAL.replace("data_dir: d\n", ""), "missing required field `data_dir`"),
        ("run_dir: [\n", "not valid YAML"),
    ],
)
def test_bad_keys_are_errors_naming_key_and_file(tmp_path: Path, text: str, needle: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_sft_config(path)
    assert str(path) in str(err.value) and needle in str(err.value)


def test_yaml_11_floats_are_accepted(tmp_path: Path) -> None:
    cfg = load_sft_config(_write(tmp_path, MINIMAL.replace("optim: {}", "optim: {lr: 1e-4}")))
    assert cfg.optim.lr == 1e-4


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_sft_config(tmp_path / "nope.yaml")


def test_example_sft_documents_every_default() -> None:
    raw = yaml.safe_load((EXAMPLES / "sft.yaml").read_text(encoding="utf-8"))
    for section, struct in (
        ("optim", OptimConfig()),
        ("train", TrainConfig()),
        ("validation", ValidationConfig()),
    ):
        documented = msgspec.convert(raw[section], type(struct), strict=False)
        assert documented == struct, section
        assert set(raw[section]) == set(struct.__struct_fields__), section
    assert set(raw) == set(SFTConfig.__struct_fields__)
    assert isinstance(load_sft_config(EXAMPLES / "sft.yaml"), SFTConfig)


def test_example_base_is_a_valid_model_config() -> None:
    run_config = load_run_config(EXAMPLES / "base.yaml")
    cfg = model_config(run_config, morph_dispatch="sparse")
    assert isinstance(cfg, ModelConfig) and cfg.morph_dispatch == "sparse"
    assert model_config(run_config, morph_dispatch=None).morph_dispatch == "masked"
