"""A base run whose weights are one model.safetensors file is found and loaded like a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nedolm.dist import get_info
from nedolm.model import build_model
from nedolm.train.base import init_base, model_config
from nedolm.train.base_weights import SAFETENSORS_WEIGHTS, load_base_state, read_base_weights
from nedolm.train.checkpoint import CheckpointError, load_checkpoint
from nedolm.train.config import load_run_config, load_sft_config
from nedolm.train.setup import prepare_run

SMALL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64}


def safetensors_base(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A base run dir holding config.yaml and only model.safetensors (bf16), and its weights."""
    written = init_base(
        tmp_path / "pt", preset_name="tiny", vocab_size=300, eos_id=2, overrides=SMALL
    )
    state = load_checkpoint(written)["model"]
    base = tmp_path / "st"
    base.mkdir()
    (base / "config.yaml").write_bytes((tmp_path / "pt" / "config.yaml").read_bytes())
    stored = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
    save_file(stored, str(base / SAFETENSORS_WEIGHTS))
    return base, stored


def test_safetensors_base_loads_through_the_base_path(tmp_path: Path) -> None:
    base, stored = safetensors_base(tmp_path)
    path, state = read_base_weights(base)
    assert path == base / SAFETENSORS_WEIGHTS
    model = build_model(model_config(load_run_config(base / "config.yaml")))
    model.load_state_dict(state)
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == (torch.float32 if tensor.is_floating_point() else tensor.dtype)
        torch.testing.assert_close(tensor, stored[name].to(tensor.dtype), rtol=0, atol=0)


def test_a_checkpoint_wins_over_the_safetensors_file(tmp_path: Path) -> None:
    base, _ = safetensors_base(tmp_path)
    checkpoint = init_base(base, preset_name="tiny", vocab_size=300, eos_id=2, overrides=SMALL)
    assert read_base_weights(base)[0] == checkpoint


def test_a_base_without_weights_names_both_places(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"checkpoints and no .*model\.safetensors"):
        read_base_weights(tmp_path)


def test_an_unreadable_safetensors_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / SAFETENSORS_WEIGHTS
    bad.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    with pytest.raises(CheckpointError, match=f"cannot read base weights {bad}"):
        load_base_state(bad)


def test_a_fresh_run_starts_from_exactly_the_base(harness, tmp_path, corpus, base_run) -> None:
    """The trainer builds its model without random draws (the base overwrites every weight,
    then rank 0 broadcasts it): what it trains is the base bit for bit, with the rotary tables
    a freshly built model has."""
    cfg = load_sft_config(
        harness.write_config(tmp_path / "sft.yaml", corpus, base_run, tmp_path / "run")
    )
    cfg.run_dir.mkdir()
    model = prepare_run(cfg, get_info(), allow_compile=False).state.model
    state, (_, base) = model.state_dict(), read_base_weights(base_run)
    assert state.keys() == base.keys()
    for name, tensor in base.items():
        assert torch.equal(state[name], tensor.to(state[name].dtype)), name
    fresh = build_model(model.cfg)
    assert torch.equal(model.rope_cos, fresh.rope_cos)
    assert torch.equal(model.rope_sin, fresh.rope_sin)
