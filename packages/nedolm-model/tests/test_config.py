import dataclasses
import json

import pytest
import torch

from nedolm.model import ModelConfig, ModelConfigError, build_model, preset, preset_names


def test_every_bad_field_is_named_in_one_error() -> None:
    with pytest.raises(ModelConfigError) as err:
        ModelConfig(d_model=0, n_kv_heads=-1, morph_dispatch="dense", attn_impl="xformers")
    message = str(err.value)
    for name in ("d_model", "n_kv_heads", "morph_dispatch", "attn_impl"):
        assert name in message


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(d_model=250, n_heads=4), "divisible by n_heads"),
        (dict(d_model=36, n_heads=4), "must be even for rotary"),
        (dict(n_heads=4, n_kv_heads=3), "divisible by n_kv_heads"),
        (dict(n_morph_classes=3, morph_expert_dim=0), "morph_expert_dim"),
        (dict(rope_theta=True), "rope_theta"),
        (dict(vocab_size=1.5), "vocab_size"),
    ],
)
def test_inconsistent_fields_are_refused(fields: dict, named: str) -> None:
    with pytest.raises(ModelConfigError, match=named):
        ModelConfig(**fields)


def test_asdict_round_trips_through_json() -> None:
    cfg = preset("tiny", rope_theta=10000)
    restored = ModelConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert restored == cfg
    assert isinstance(restored.rope_theta, float)


def test_padded_vocab_is_the_next_multiple_of_64() -> None:
    assert ModelConfig(vocab_size=32003).padded_vocab_size == 32064
    assert ModelConfig(vocab_size=64).padded_vocab_size == 64
    assert ModelConfig(vocab_size=65).padded_vocab_size == 128


def test_tiny_preset_has_the_documented_shape() -> None:
    cfg = preset("tiny")
    shape = (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.max_seq_len)
    assert shape == (256, 4, 4, 2, 704, 1024)
    assert cfg.n_morph_classes == 3 and cfg.morph_expert_dim > 0


def test_08b_preset_size_and_context() -> None:
    cfg = preset("nedolm-0.8b")
    with torch.device("meta"):  # count parameters without allocating 3 GB
        n_params = build_model(cfg).num_params()
    assert 0.75e9 <= n_params <= 0.85e9
    assert cfg.max_seq_len == 4096


def test_preset_overrides_and_errors() -> None:
    assert preset("tiny", n_layers=2, morph_dispatch="sparse").n_layers == 2
    assert set(preset_names()) == {"tiny", "nedolm-0.8b"}
    with pytest.raises(ModelConfigError, match="unknown model preset 'huge'"):
        preset("huge")
    with pytest.raises(ModelConfigError, match="d_modle"):
        preset("tiny", d_modle=128)


def test_grouped_dispatch_on_a_torch_without_grouped_gemms_is_refused(monkeypatch) -> None:
    import torch

    assert preset("tiny", morph_dispatch="grouped").morph_dispatch == "grouped"
    monkeypatch.delattr(torch, "_grouped_mm")
    with pytest.raises(ModelConfigError, match=r"'grouped' needs torch._grouped_mm.*'masked'"):
        preset("tiny", morph_dispatch="grouped")
