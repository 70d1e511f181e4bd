"""``base_hf_dir`` in the SFT YAML: resolved like the other paths, exclusive with a base run."""

from __future__ import annotations

from pathlib import Path

import pytest

from nedolm.train.config import ConfigError, load_sft_config

COMMON = "run_dir: r\ndata_dir: d\noptim: {}\ntrain: {}\n"


def _load(tmp_path: Path, text: str):
    path = tmp_path / "sft.yaml"
    path.write_text(COMMON + text, encoding="utf-8")
    return load_sft_config(path)


def test_base_hf_dir_resolves_against_the_yaml_dir(tmp_path: Path) -> None:
    cfg = _load(tmp_path, "base_hf_dir: models/llama\nbase_morph_expert_dim: 32\n")
    assert cfg.base_hf_dir == tmp_path / "models" / "llama" and cfg.base_morph_expert_dim == 32
    assert cfg.base_config is None and cfg.base_run_dir is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "base_hf_dir: m\nbase_run_dir: br\n",
            "base_hf_dir cannot be combined with base_config/base_run_dir/base_checkpoint",
        ),
        (
            "base_hf_dir: m\nbase_checkpoint: ck.pt\n",
            "base_hf_dir cannot be combined with base_config/base_run_dir/base_checkpoint",
        ),
        ("base_run_dir: br\n", "give base_config and base_run_dir, or base_hf_dir"),
        ("", "give base_config and base_run_dir, or base_hf_dir"),
        (
            "base_config: b.yaml\nbase_run_dir: br\nbase_morph_expert_dim: 8\n",
            "base_morph_expert_dim must be >= 0 and needs base_hf_dir",
        ),
    ],
)
def test_base_choice_errors_name_the_keys(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"sft\.yaml: {message}"):
        _load(tmp_path, text)
