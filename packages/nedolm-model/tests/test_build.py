"""`build_model(cfg, init_weights=False)`: a model to load weights into, without the random
draws the load overwrites (seconds for nedolm-0.8b), equal to the model it loads."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

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


class _CPUOutputs(TorchDispatchMode):
    """(op name, element count) of each tensor that an op produces on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                self.outputs.append((func.overloadpacket.__name__, tensor.numel()))
        return out


def test_a_model_built_for_a_device_is_never_allocated_on_the_host(make_config) -> None:
    """A trainer on a GPU builds there: no host copy of the weights to move. The meta device
    stands in for the GPU; only the rotary tables are computed on the host, by design."""
    cfg = make_config()
    with _CPUOutputs() as host:
        model = build_model(cfg, init_weights=False, device="meta")
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    assert max(n for _, n in host.outputs) <= cfg.max_seq_len * cfg.head_dim  # a rope table
    assert cfg.padded_vocab_size * cfg.d_model > cfg.max_seq_len * cfg.head_dim


def test_the_device_given_wins_over_the_default_and_the_tables_do_not_move(make_config) -> None:
    """Built for the CPU under a meta default device: everything real, and the rotary tables are
    bit-equal to a plain build (computed on the host wherever the model lives)."""
    cfg = make_config()
    plain = build_model(cfg, init_weights=False)
    with torch.device("meta"):
        model = build_model(cfg, init_weights=False, device="cpu")
        fresh = build_model(cfg, device="cpu")
    for built in (model, fresh):
        assert {t.device.type for t in [*built.parameters(), *built.buffers()]} == {"cpu"}
        assert torch.equal(built.rope_cos, plain.rope_cos)
        assert torch.equal(built.rope_sin, plain.rope_sin)


@pytest.mark.parametrize("init_weights", [False, True], ids=["empty", "initialised"])
def test_a_model_built_in_a_dtype_is_the_model_converted(make_config, init_weights) -> None:
    """``dtype`` gives what ``.to(dtype)`` gives (rotary tables included); an empty model is
    allocated in it, not converted from float32 (for generate on a GPU: no float32 model of
    uninitialised memory to round)."""
    cfg = make_config()
    torch.manual_seed(0)
    converted = build_model(cfg, init_weights=init_weights).to(torch.bfloat16)
    torch.manual_seed(0)
    with _CPUOutputs() as host:
        built = build_model(cfg, init_weights=init_weights, dtype=torch.bfloat16)
    assert built.tok_embeddings.weight.dtype == torch.bfloat16
    assert torch.equal(built.rope_cos, converted.rope_cos)
    assert torch.equal(built.rope_sin, converted.rope_sin)
    if init_weights:
        for name, tensor in converted.state_dict().items():
            assert torch.equal(built.state_dict()[name], tensor), name
    else:
        conversions = [n for op, n in host.outputs if op == "_to_copy"]
        assert max(conversions) <= cfg.max_seq_len * cfg.head_dim  # the rotary tables only
