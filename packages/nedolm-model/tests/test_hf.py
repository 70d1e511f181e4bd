import dataclasses
import json
import os

import pytest
import torch
from transformers import LlamaForCausalLM

from nedolm.model import ExportFormatError, HFImportError, build_model, export_hf, load_hf, preset


def test_dense_export_loads_in_transformers_with_the_same_logits(make_model, tmp_path) -> None:
    model = make_model(seed=7, n_morph_classes=0, morph_expert_dim=0, rope_theta=500000.0).eval()
    export_hf(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    hf = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    input_ids = torch.randint(0, model.cfg.vocab_size, (3, 50))
    with torch.no_grad():
        want = hf(input_ids).logits
        _, got = model(input_ids)
    assert got.shape == want.shape == (3, 50, model.cfg.vocab_size)
    assert (got - want).abs().max() <= 1e-4


@pytest.mark.parametrize("morph", [True, False])
def test_load_hf_round_trips_exactly(make_model, tmp_path, morph: bool) -> None:
    dense = dict(n_morph_classes=0, morph_expert_dim=0)
    model = make_model(seed=8, **({} if morph else dense)).eval()
    export_hf(model, tmp_path)
    loaded = load_hf(tmp_path).eval()
    # A Hugging Face config has no field for our backend choice, so an export loads as "auto".
    assert loaded.cfg == dataclasses.replace(model.cfg, attn_impl="auto")
    input_ids = torch.randint(0, model.cfg.vocab_size, (2, 30))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids)[1], model(input_ids)[1])
    if morph:
        config = json.loads((tmp_path / "config.json").read_text())
        assert config["architectures"] == ["NedoLMForCausalLM"]
        assert torch.equal(loaded.morph_classes, model.morph_classes)


def test_load_hf_overrides_and_bf16_export(make_model, tmp_path) -> None:
    model = make_model(n_morph_classes=0, morph_expert_dim=0)
    export_hf(model, tmp_path, dtype=torch.bfloat16)
    loaded = load_hf(tmp_path, attn_impl="auto", max_seq_len=64)
    assert loaded.cfg.attn_impl == "auto" and loaded.cfg.max_seq_len == 64
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_load_hf_names_the_broken_file(make_model, tmp_path) -> None:
    with pytest.raises(ExportFormatError, match=r"config\.json: missing"):
        load_hf(tmp_path)
    export_hf(make_model(n_morph_classes=0, morph_expert_dim=0), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(
        HFImportError, match=r"model\.safetensors: missing tensor 'model\.layers\.2"
    ):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(HFImportError, match=r"config\.json: unsupported model_type 'gpt2'"):
        load_hf(tmp_path)


def test_load_hf_reads_a_checkpoint_saved_by_transformers(tmp_path) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=130,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path, attn_impl="sdpa").eval()
    assert ours.cfg.padded_vocab_size == 192
    input_ids = torch.randint(0, 130, (2, 40))
    with torch.no_grad():
        assert (ours(input_ids)[1] - hf(input_ids).logits).abs().max() <= 1e-4


def test_exported_files_follow_the_umask(tmp_path) -> None:
    model = build_model(preset("tiny", n_morph_classes=0, morph_expert_dim=0, vocab_size=128))
    old = os.umask(0o022)
    try:
        export_hf(model, tmp_path / "out")
    finally:
        os.umask(old)
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "out" / name).stat().st_mode & 0o777 == 0o644, name
