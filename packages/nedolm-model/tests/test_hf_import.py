"""Checkpoints saved by `transformers` import with the same logits; what we lack is refused."""

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from nedolm.model import (
    HFImportError,
    ModelConfigError,
    add_morph_experts,
    export_hf,
    generate,
    grow_vocab,
    import_hf,
    morph_classes_from_vocab,
)

VOCAB = 150
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
VARIANTS = {
    "tied": dict(tie_word_embeddings=True),
    "untied": dict(tie_word_embeddings=False),
    "gqa-4:1": dict(num_key_value_heads=1, tie_word_embeddings=False),
    "llama3-rope": dict(rope_scaling=LLAMA3, rope_theta=500000.0, tie_word_embeddings=True),
}


def llama(tmp_path: Path, seed: int = 0, **overrides: object) -> tuple[LlamaForCausalLM, Path]:
    """A tiny random Llama saved by transformers into tmp_path/hf."""
    torch.manual_seed(seed)
    # deepcopy: transformers writes rope_theta into the rope_scaling dict it is given.
    model = LlamaForCausalLM(LlamaConfig(**copy.deepcopy({**TINY, **overrides}))).eval()
    out = tmp_path / "hf"
    model.save_pretrained(out)
    return model, out


def max_logit_diff(ours: torch.nn.Module, theirs: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        _, got = ours.eval()(ids)
        want = theirs(ids).logits
    assert got.shape == want.shape
    return (got - want).abs().max().item()


def token_ids(rows: int = 2, length: int = 100) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_llama_saved_by_transformers_imports_with_the_same_logits(tmp_path, variant) -> None:
    theirs, hf_dir = llama(tmp_path, **VARIANTS[variant])
    ours = import_hf(hf_dir, attn_impl="sdpa")
    assert ours.cfg.tie_embeddings == VARIANTS[variant]["tie_word_embeddings"]
    assert (ours.output is None) == ours.cfg.tie_embeddings
    assert max_logit_diff(ours, theirs, token_ids()) <= 1e-4


def test_llama3_rope_scaling_changes_the_model(tmp_path) -> None:
    """The llama3 test above could pass by ignoring the scaling if it changed nothing."""
    scaled, hf_dir = llama(tmp_path, rope_scaling=LLAMA3)
    plain = import_hf(hf_dir, attn_impl="sdpa", rope_scaling=None)
    assert import_hf(hf_dir).cfg.rope_scaling == LLAMA3
    assert max_logit_diff(plain, scaled, token_ids()) > 1e-3


def test_mistral_without_sliding_window_imports(tmp_path) -> None:
    torch.manual_seed(0)
    theirs = MistralForCausalLM(MistralConfig(**TINY, sliding_window=None)).eval()
    theirs.save_pretrained(tmp_path)
    assert max_logit_diff(import_hf(tmp_path, attn_impl="sdpa"), theirs, token_ids()) <= 1e-4


def test_sharded_checkpoint_imports_identically(tmp_path) -> None:
    theirs, hf_dir = llama(tmp_path, tie_word_embeddings=False)
    sharded = tmp_path / "sharded"
    theirs.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    whole, parts = import_hf(hf_dir).state_dict(), import_hf(sharded).state_dict()
    assert whole.keys() == parts.keys()
    assert all(torch.equal(whole[k], parts[k]) for k in whole)


def test_generate_equals_transformers_greedy_decoding(tmp_path) -> None:
    theirs, hf_dir = llama(tmp_path, tie_word_embeddings=False, rope_scaling=LLAMA3)
    ours = import_hf(hf_dir, attn_impl="sdpa")
    prompt = token_ids(1, 12)[0].tolist()
    got = list(generate(ours, prompt, max_new_tokens=20))
    want = theirs.generate(
        torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None
    )
    assert got == want[0, len(prompt) :].tolist()


@pytest.mark.parametrize("tied", [True, False])
def test_export_round_trips_tying_and_rope_scaling(tmp_path, tied) -> None:
    theirs, hf_dir = llama(tmp_path, tie_word_embeddings=tied, rope_scaling=LLAMA3)
    export_hf(import_hf(hf_dir), tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert reloaded.config.tie_word_embeddings is tied
    ids = token_ids()
    with torch.no_grad():
        assert (reloaded(ids).logits - theirs(ids).logits).abs().max() <= 1e-4


def edit_config(hf_dir: Path, **changes: object) -> None:
    path = hf_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


REFUSED = [
    ({"attention_bias": True}, "unsupported attention_bias True"),
    ({"mlp_bias": True}, "unsupported mlp_bias True"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ({"sliding_window": 4096}, "unsupported sliding_window 4096"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "unsupported quantization_config"),
    (
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
        "unsupported rope_parameters rope_type 'yarn'",
    ),
    (
        {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}},
        "unsupported rope_scaling rope_type 'linear'",
    ),
    ({"architectures": ["Qwen2ForCausalLM"]}, "unsupported architectures \\['Qwen2ForCausalLM'\\]"),
    ({"model_type": "gemma"}, "unsupported model_type 'gemma'"),
    ({"head_dim": 32}, "unsupported head_dim 32"),
]


@pytest.mark.parametrize(("changes", "message"), REFUSED, ids=[m.split()[1] for _, m in REFUSED])
def test_unsupported_config_field_is_refused_naming_it(tmp_path, changes, message) -> None:
    _, hf_dir = llama(tmp_path)
    edit_config(hf_dir, **changes)
    with pytest.raises(HFImportError, match=rf"^{hf_dir / 'config.json'}: {message}") as err:
        import_hf(hf_dir)
    assert "\n" not in str(err.value)


def test_directory_without_config_json(tmp_path) -> None:
    with pytest.raises(HFImportError, match=rf"^{tmp_path / 'config.json'}: missing$"):
        import_hf(tmp_path)


def test_missing_config_field_is_named(tmp_path) -> None:
    _, hf_dir = llama(tmp_path)
    config = json.loads((hf_dir / "config.json").read_text())
    del config["intermediate_size"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFImportError, match=r"config\.json: missing field 'intermediate_size'"):
        import_hf(hf_dir)


def test_missing_shard_is_named(tmp_path) -> None:
    theirs, _ = llama(tmp_path)
    sharded = tmp_path / "sharded"
    theirs.save_pretrained(sharded, max_shard_size="40KB")
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(HFImportError, match=rf"^{victim}: missing \(listed in model\.safetensors"):
        import_hf(sharded)


def test_shape_that_disagrees_with_the_config_is_named(tmp_path) -> None:
    _, hf_dir = llama(tmp_path)
    edit_config(hf_dir, intermediate_size=128)
    with pytest.raises(
        HFImportError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.down_proj\.weight' has shape "
        r"\[64, 96\], config\.json implies \[64, 128\]",
    ):
        import_hf(hf_dir)


def test_missing_and_unexpected_tensors_are_named(tmp_path) -> None:
    _, hf_dir = llama(tmp_path, tie_word_embeddings=True)
    edit_config(hf_dir, tie_word_embeddings=False)
    with pytest.raises(
        HFImportError, match=r"model\.safetensors: missing tensor 'lm_head\.weight'"
    ):
        import_hf(hf_dir)
    edit_config(hf_dir, tie_word_embeddings=True, num_hidden_layers=1)
    with pytest.raises(
        HFImportError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.1\."
    ):
        import_hf(hf_dir)


@pytest.mark.parametrize("tied", [True, False])
def test_grown_vocab_keeps_every_old_logit(tmp_path, tied) -> None:
    _, hf_dir = llama(tmp_path, tie_word_embeddings=tied)
    base = import_hf(hf_dir, attn_impl="sdpa").eval()
    grown = grow_vocab(base, VOCAB + 3).eval()
    assert grown.cfg.vocab_size == VOCAB + 3 and grown.cfg.padded_vocab_size == 192
    ids = token_ids()
    with torch.no_grad():
        old, new = base(ids)[1], grown(ids)[1]
    assert torch.equal(new[..., :VOCAB], old)
    for weight in {grown.tok_embeddings.weight, grown.output_weight}:
        mean = weight[:VOCAB].mean(0)
        torch.testing.assert_close(weight[VOCAB : VOCAB + 3], mean.expand(3, -1))
        assert not weight[VOCAB + 3 :].any()
    with pytest.raises(ValueError, match="smaller than the model's 153"):
        grow_vocab(grown, VOCAB)


@pytest.mark.parametrize("dispatch", ["masked", "sparse", "grouped"])
def test_morph_experts_on_a_dense_base_change_nothing_at_step_0(tmp_path, dispatch) -> None:
    _, hf_dir = llama(tmp_path, tie_word_embeddings=False)
    dense = import_hf(hf_dir, attn_impl="sdpa").eval()
    pieces = ["\u2581ev", "ler", "12", *(["\u2581a", "b"] * 80)][:VOCAB]
    morph = add_morph_experts(dense, 16, morph_classes_from_vocab(pieces), dispatch=dispatch)
    assert morph.cfg.n_morph_classes == 3 and morph.morph_classes[:3].tolist() == [0, 1, 2]
    ids = token_ids()
    with torch.no_grad():
        assert torch.equal(morph.eval()(ids)[1], dense(ids)[1])
    loss, _ = morph.train()(ids, ids, return_logits=False)
    loss.backward()
    assert morph.blocks[0].morph.w_down.grad.abs().sum() > 0  # the experts can learn


def test_rope_scaling_config_is_validated(make_config) -> None:
    with pytest.raises(ModelConfigError, match="rope_scaling needs exactly"):
        make_config(rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ModelConfigError, match="rope_type 'llama3'"):
        make_config(rope_scaling={"rope_type": "yarn"})
