"""A morph export is a transformers model: its own loader code, our logits, KV-cached generate.

transformers is the reference here: the export is loaded only through
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``, which imports the shipped
``modeling_nedolm.py`` from its module cache, an implementation separate from ours.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

from nedolm.model import ExportFormatError, HFImportError, export_hf, generate, load_hf
from nedolm.model.hf import TokenIds

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
VARIANTS = {
    "tied": {},
    "untied-llama3-mqa": dict(
        tie_embeddings=False, rope_scaling=LLAMA3, rope_theta=500000.0, n_kv_heads=1
    ),
}


def load_remote(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_morph_export_loads_in_transformers_with_our_logits(make_model, tmp_path, variant) -> None:
    model = make_model(seed=11, **VARIANTS[variant]).eval()
    export_hf(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "configuration_nedolm.py",
        "model.safetensors",
        "modeling_nedolm.py",
    ]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "llama"  # transformers reads it without remote code
    assert config["architectures"] == ["NedoLMForCausalLM"]
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM"}
    assert AutoConfig.from_pretrained(tmp_path, trust_remote_code=True).num_morph_classes == 3
    theirs = load_remote(tmp_path)
    assert type(theirs).__name__ == "NedoLMForCausalLM"
    assert torch.equal(theirs.model.morph_classes, model.morph_classes[: model.cfg.vocab_size])
    input_ids = torch.randint(0, model.cfg.vocab_size, (3, 70))
    with torch.no_grad():
        _, want = model(input_ids)
        got = theirs(input_ids).logits
    assert got.shape == want.shape == (3, 70, model.cfg.vocab_size)
    assert (got - want).abs().max() <= 1e-5


def test_transformers_sees_the_morph_routing(make_model, tmp_path) -> None:
    """The logits depend on the class buffer that travels in the safetensors."""
    model = make_model(seed=12).eval()
    export_hf(model, tmp_path)
    theirs = load_remote(tmp_path)
    input_ids = torch.randint(0, model.cfg.vocab_size, (1, 30))
    with torch.no_grad():
        before = theirs(input_ids).logits
        theirs.model.morph_classes.copy_((theirs.model.morph_classes + 1) % 3)
        after = theirs(input_ids).logits
    assert (before - after).abs().max() > 1e-3


def test_transformers_greedy_generate_equals_ours(make_model, tmp_path) -> None:
    model = make_model(seed=13, init_std=0.2).eval()  # at 0.02 a random model repeats one id
    export_hf(model, tmp_path)
    theirs = load_remote(tmp_path)
    prompt = torch.randint(
        0, model.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(1)
    )
    ours = list(generate(model, prompt, max_new_tokens=40))
    out = theirs.generate(
        prompt[None], max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert out[0, 12:].tolist() == ours
    assert len(set(ours)) > 1  # a constant reply would hide a cache that is never read


def test_padded_batch_generates_what_each_row_generates_alone(make_model, tmp_path) -> None:
    """Left padding: the attention mask hides the pads and positions start at each row's text."""
    model = make_model(seed=14, init_std=0.2).eval()
    export_hf(model, tmp_path)
    theirs = load_remote(tmp_path)
    g = torch.Generator().manual_seed(2)
    short, long = (torch.randint(1, model.cfg.vocab_size, (n,), generator=g) for n in (6, 10))
    batch = torch.zeros(2, 10, dtype=torch.long)
    batch[0, 4:], batch[1] = short, long
    mask = (torch.arange(10) >= torch.tensor([[4], [0]])).long()
    out = theirs.generate(
        batch, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip
    for row, prompt in enumerate((short, long)):
        alone = list(generate(model, prompt, max_new_tokens=16))
        assert out[row, 10:].tolist() == alone, row
        assert len(set(alone)) > 1


def test_labels_give_the_shifted_cross_entropy_we_train_with(make_model, tmp_path) -> None:
    model = make_model(seed=15).eval()
    export_hf(model, tmp_path)
    theirs = load_remote(tmp_path)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 33))
    labels = ids.clone()
    labels[:, :10] = -100  # context positions
    with torch.no_grad():
        want, _ = model(ids[:, :-1], labels[:, 1:], return_logits=False)
        got = theirs(ids, labels=labels).loss
    assert abs(got.item() - want.item()) <= 1e-5


@pytest.mark.parametrize("tied", [True, False])
def test_save_pretrained_round_trips_with_the_loader_code(make_model, tmp_path, tied) -> None:
    model = make_model(seed=16, tie_embeddings=tied).eval()
    export_hf(model, tmp_path / "export")
    theirs = load_remote(tmp_path / "export")
    theirs.save_pretrained(tmp_path / "saved")
    saved = {p.name for p in (tmp_path / "saved").iterdir()}
    assert {"config.json", "configuration_nedolm.py", "modeling_nedolm.py"} <= saved
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"].endswith("modeling_nedolm.NedoLMForCausalLM")
    again = load_remote(tmp_path / "saved")
    ids = torch.randint(0, model.cfg.vocab_size, (2, 25))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, theirs(ids).logits)
    # Our loader reads what transformers wrote, too.
    ours = load_hf(tmp_path / "saved", attn_impl="sdpa").eval()
    with torch.no_grad():
        assert (ours(ids)[1] - model(ids)[1]).abs().max() <= 1e-6


def test_bf16_export_keeps_the_classes_exact(make_model, tmp_path) -> None:
    model = make_model(seed=17)
    export_hf(model, tmp_path, dtype=torch.bfloat16)
    tensors = load_file(tmp_path / "model.safetensors")
    assert tensors["model.morph_classes"].dtype == torch.int64
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    assert torch.equal(theirs.model.morph_classes, model.morph_classes[: model.cfg.vocab_size])


def test_load_hf_reads_the_legacy_morph_format(make_model, tmp_path) -> None:
    """Morph exports written before the loader code shipped: our names + nedolm_config."""
    model = make_model(seed=18).eval()
    config = {
        "model_type": "nedolm_morph",
        "format_version": 1,
        "nedolm_config": model.cfg.to_dict(),
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors"
    )
    loaded = load_hf(tmp_path).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (1, 20))
    with torch.no_grad():
        assert torch.equal(loaded(ids)[1], model(ids)[1])
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ExportFormatError, match=r"model\.safetensors: missing"):
        load_hf(tmp_path)


def test_load_hf_refuses_morph_classes_out_of_range(make_model, tmp_path) -> None:
    export_hf(make_model(seed=19), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.morph_classes"][5] = 3
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        HFImportError, match=r"model\.safetensors: tensor 'model\.morph_classes' must hold integer"
    ):
        load_hf(tmp_path)


def test_a_morph_export_refuses_to_load_as_a_plain_llama(make_model, tmp_path) -> None:
    """Without trust_remote_code transformers would build a Llama, the experts dropped: it fails
    instead, naming the way to load it; its config (all a tokenizer needs) reads as Llama's."""
    export_hf(make_model(seed=20), tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "llama"
    for loader in (AutoModelForCausalLM, LlamaForCausalLM):
        with pytest.raises(KeyError, match="trust_remote_code=True"):
            loader.from_pretrained(tmp_path)


def test_load_hf_reads_a_morph_export_of_model_type_nedolm(make_model, tmp_path) -> None:
    """Morph exports written before they took model_type llama load as they did."""
    model = make_model(seed=21).eval()
    export_hf(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["hidden_act"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "nedolm"}))
    ids = torch.randint(0, model.cfg.vocab_size, (1, 20))
    with torch.no_grad():
        assert torch.equal(load_hf(tmp_path).eval()(ids)[1], model(ids)[1])


@pytest.mark.parametrize("morph", [True, False])
def test_config_json_carries_the_token_ids(make_model, tmp_path, morph: bool) -> None:
    dense = dict(n_morph_classes=0, morph_expert_dim=0)
    model = make_model(seed=22, **({} if morph else dense))
    export_hf(model, tmp_path / "with", token_ids=TokenIds(eos=2, pad=202, bos=1))
    export_hf(model, tmp_path / "without")
    keys = ("eos_token_id", "bos_token_id", "pad_token_id")
    for name, want in (("with", (2, 1, 202)), ("without", (None, None, None))):
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert tuple(config[k] for k in keys) == want, name
        loaded = AutoConfig.from_pretrained(tmp_path / name, trust_remote_code=morph)
        assert tuple(getattr(loaded, k) for k in keys) == want, name
