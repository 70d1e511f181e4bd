import functools

import pytest
import torch

from nedolm.model import IGNORE_INDEX, packed_layout
from nedolm.model.attention import VarlenLayout, build_layout

# Warnings raised inside torch itself while compiling (torch 2.13): inductor's imports touch
# the deprecated torch.jit.script_method, dynamo probes .grad of non-leaf tensors and
# instantiates the loss head's autograd.Function while tracing it.
pytestmark = [
    pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings(
        "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"
    ),
]


def packed_batch(vocab_size: int):
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, vocab_size, (2, 32), generator=gen)
    input_ids[0, 10] = input_ids[1, 20] = 2
    labels = torch.randint(0, vocab_size, (2, 32), generator=gen)
    labels[:, :12] = -100
    cu_seqlens, position_ids = packed_layout(input_ids, eos_id=2)
    return input_ids, labels, dict(cu_seqlens=cu_seqlens, position_ids=position_ids)


@pytest.mark.parametrize("dispatch", ["masked", "grouped"])
@pytest.mark.parametrize("planned", [True, False], ids=["eager-plan", "op-plan"])
def test_static_dispatch_block_traces_as_one_graph(make_model, planned: bool, dispatch) -> None:
    model = make_model(morph_dispatch=dispatch)
    input_ids, _, layout = packed_batch(model.cfg.vocab_size)
    ids_T, positions_T = input_ids.reshape(-1), layout["position_ids"].reshape(-1)
    args = (
        model.tok_embeddings(ids_T),
        model.rope_cos[positions_T],
        model.rope_sin[positions_T],
        build_layout("sdpa", layout["cu_seqlens"], None, ids_T.numel())
        if planned  # what a compiled model.forward hands its blocks: the op plans inside
        else VarlenLayout("sdpa", layout["cu_seqlens"].int(), 0, [], None),
        model._route(ids_T),
    )
    explanation = torch._dynamo.explain(model.blocks[0])(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def train_steps(model, batch, steps: int) -> list[float]:
    input_ids, labels, layout = batch
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss, _ = model(input_ids, labels, return_logits=False, loss_reduction="sum", **layout)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def compile_model(model, how: str, backend: str):
    """The whole model in one graph (`torch.compile`), or each block on its own (the trainer's
    `compile_blocks`)."""
    if how == "model":
        return torch.compile(model, backend=backend)
    model.compile_blocks(backend=backend)
    return model


def assert_compiled_training_matches_eager(
    make_model, how: str, backend: str, tol: float, grad_checkpoint: bool = False
) -> None:
    eager, compiled = make_model(seed=1), make_model(seed=2)
    compiled.load_state_dict(eager.state_dict())
    compiled.grad_checkpoint = grad_checkpoint
    batch = packed_batch(eager.cfg.vocab_size)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    want = train_steps(eager, batch, 3)
    got = train_steps(compile_model(compiled, how, backend), batch, 3)
    assert torch._dynamo.utils.counters["frames"]["ok"] >= 1  # it did run compiled
    torch.testing.assert_close(got, want, atol=0, rtol=tol)
    for (name, param), ref in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(param, ref, atol=tol, rtol=tol, msg=name)


HOW = pytest.mark.parametrize("how", ["model", "blocks"])


@HOW
@pytest.mark.parametrize("grad_checkpoint", [False, True])
def test_compiled_forward_backward_matches_eager(make_model, how, grad_checkpoint: bool) -> None:
    assert_compiled_training_matches_eager(make_model, how, "aot_eager", 1e-5, grad_checkpoint)


@HOW
def test_compiled_grouped_dispatch_trains_as_eager(make_model, how) -> None:
    grouped = functools.partial(make_model, morph_dispatch="grouped")
    assert_compiled_training_matches_eager(grouped, how, "aot_eager", 1e-5)


@pytest.mark.slow
@HOW
def test_inductor_compiled_training_matches_eager(make_model, how) -> None:
    assert_compiled_training_matches_eager(make_model, how, "inductor", 1e-4)


def test_compiled_blocks_share_one_graph_and_eval_mode_runs_them_eagerly(make_model) -> None:
    """Four blocks, one traced frame; eval mode (validation, generation) traces nothing."""
    model = make_model(n_layers=4)
    input_ids, labels, layout = packed_batch(model.cfg.vocab_size)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    model.compile_blocks(backend="aot_eager")
    assert model.blocks_compiled
    train_steps(model, (input_ids, labels, layout), 2)
    assert counters["frames"]["ok"] == 1 and not counters["graph_break"]
    model.eval()
    with torch.no_grad():
        model(input_ids, labels, return_logits=False, **layout)
    assert counters["frames"]["ok"] == 1
    assert set(model.state_dict()) == set(make_model(n_layers=4).state_dict())  # no new names
    model.uncompile_blocks()
    model.train()
    train_steps(model, (input_ids, labels, layout), 1)
    assert not model.blocks_compiled and counters["frames"]["ok"] == 1


@HOW
def test_new_packings_do_not_recompile(make_model, how) -> None:
    model = make_model()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = compile_model(model, how, "aot_eager")
    frames = []
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(3, model.cfg.vocab_size, (2, 32), generator=gen)
        input_ids.view(-1)[torch.randint(0, 64, (2 + 3 * seed,), generator=gen)] = 2
        cu_seqlens, position_ids = packed_layout(input_ids, eos_id=2)
        labels = input_ids.roll(-1, dims=1)
        labels.view(-1)[torch.randperm(64, generator=gen)[: 5 + 7 * seed]] = IGNORE_INDEX
        loss, _ = compiled(
            input_ids, labels, return_logits=False, cu_seqlens=cu_seqlens, position_ids=position_ids
        )
        loss.backward()
        frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    # Whole model: step 2 recompiles once to make the token count dynamic; new packings and
    # new target counts (the loss head is one opaque op) then reuse the graphs. Compiled
    # blocks get the segment count as a dynamic size from the start: one graph throughout.
    assert frames[0] > 0 and frames[1] == frames[2] == frames[3], frames
    if how == "blocks":
        assert frames == [1, 1, 1, 1], frames
