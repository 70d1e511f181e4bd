"""`build_model(cfg, init_weights=False)`: a model to load weights into, without the random
draws the load overwrites (seconds for nedolm-0.8b), equal to the model it loads."""

from __future__ import annotations

import pytest
import torch

from nedolm.model import build_model

# Scaled rotary tables: the buffers a built-without-init model computes must follow them.
LLAMA3 = dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=32)
LLAMA3 |= dict(low_freq_factor=1.0, high_freq_factor=4.0)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_embeddings": True, "rope_scaling": LLAMA3},
        {"n_morph_classes": 0, "morph_expert_dim": 0},
    ],
    ids=["morph", "tied-llama3-rope", "dense"],
)
def test_a_model_built_without_init_loads_into_the_same_model(make_model, overrides) -> None:
    trained = make_model(seed=3, **overrides)
    empty = build_model(trained.cfg, init_weights=False)
    # The buffers that no state dict carries are computed, as a fresh model's are.
    assert torch.equal(empty.rope_cos, trained.rope_cos)
    assert torch.equal(empty.rope_sin, trained.rope_sin)
    if trained.cfg.n_morph_classes:
        assert set(empty.morph_classes.tolist()) == {trained.cfg.n_morph_classes - 1}
    empty.load_state_dict(trained.state_dict())
    got, want = empty.state_dict(keep_vars=True), trained.state_dict(keep_vars=True)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
        assert got[name].requires_grad == tensor.requires_grad, name
    input_ids = torch.randint(0, trained.cfg.vocab_size, (2, 24))
    assert torch.equal(empty(input_ids)[1], trained(input_ids)[1])


def test_a_model_built_without_init_takes_only_a_whole_state_dict(make_model) -> None:
    """Its parameters hold whatever memory held: a state dict missing one must not load."""
    state = make_model().state_dict()
    del state["norm.weight"]
    empty = build_model(make_model().cfg, init_weights=False)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"norm.weight\""):
        empty.load_state_dict(state)


def test_building_without_init_leaves_the_random_stream_alone(make_config) -> None:
    torch.manual_seed(0)
    build_model(make_config(), init_weights=False)
    after = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(4))
