import pytest
import torch
import torch.nn.functional as F

from nedolm.model import morph_classes_from_vocab, packed_layout
from nedolm.model.morph import CONTINUATION, OTHER, WORD_INITIAL, MorphExperts, MorphRoute


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).detach().norm() / want.detach().norm().clamp_min(1e-30))


def test_vocab_rule_on_turkish_pieces() -> None:
    pieces = {
        "▁ev": WORD_INITIAL,
        "▁üzerinden": WORD_INITIAL,
        "▁ABD": WORD_INITIAL,
        "ler": CONTINUATION,
        "ğü": CONTINUATION,
        "bulunabilirsiniz": CONTINUATION,
        "▁": OTHER,
        "▁11": OTHER,
        "7.5": OTHER,
        ".": OTHER,
        "'": OTHER,
        "▁3D": OTHER,
        "<s>": OTHER,
        "<0x0A>": OTHER,
        "<|mesaj_basla|>": OTHER,
    }
    classes = morph_classes_from_vocab(list(pieces))
    assert classes.dtype == torch.long
    assert classes.tolist() == list(pieces.values())


def test_set_morph_classes_pads_with_the_last_class(make_model) -> None:
    model = make_model()
    model.set_morph_classes(torch.tensor([0, 1, 0]))
    assert model.morph_classes[:3].tolist() == [0, 1, 0]
    assert (model.morph_classes[3:] == 2).all()
    assert "morph_classes" in model.state_dict()
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        model.set_morph_classes(torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="at most vocab_size=203"):
        model.set_morph_classes(torch.zeros(300, dtype=torch.long))
    with pytest.raises(ValueError, match="dense"):
        make_model(n_morph_classes=0, morph_expert_dim=0).set_morph_classes(torch.tensor([0]))


def slow_experts(experts: MorphExperts, x_TD: torch.Tensor, classes_T: torch.Tensor):
    """Each token through its own class's expert, one token at a time."""
    E = experts.expert_dim
    rows = []
    for x_D, c in zip(x_TD, classes_T.tolist(), strict=True):
        gate, up, down = (
            experts.w_gate[c * E : (c + 1) * E],
            experts.w_up[c * E : (c + 1) * E],
            experts.w_down[:, c * E : (c + 1) * E],
        )
        rows.append(down @ (F.silu(gate @ x_D) * (up @ x_D)))
    return torch.stack(rows)


@pytest.mark.parametrize("dispatch", ["masked", "sparse", "grouped"])
def test_dispatch_equals_per_token_experts(dispatch: str) -> None:
    torch.manual_seed(0)
    experts = MorphExperts(d_model=32, n_classes=3, expert_dim=8, dispatch=dispatch)
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x_TD = torch.randn(40, 32)
    classes_T = torch.randint(0, 2, (40,))  # class 2 unused: an empty sparse group
    got = experts(x_TD, MorphRoute(classes_T, 3, 8, dispatch))
    torch.testing.assert_close(got, slow_experts(experts, x_TD, classes_T), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dispatch", ["sparse", "grouped"])
def test_masked_and_other_dispatch_agree_in_loss_and_every_gradient(make_model, dispatch) -> None:
    masked = make_model(seed=3, morph_dispatch="masked")
    sparse = make_model(seed=4, morph_dispatch=dispatch)
    sparse.load_state_dict(masked.state_dict())
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, masked.cfg.vocab_size, (2, 48), generator=gen)
    input_ids[0, 20] = input_ids[1, 5] = 2  # EOS: packed segments
    labels = torch.randint(0, masked.cfg.vocab_size, (2, 48), generator=gen)
    labels[torch.rand(2, 48, generator=gen) < 0.6] = -100
    cu_seqlens, position_ids = packed_layout(input_ids, eos_id=2)
    losses = []
    for model in (masked, sparse):
        loss, _ = model(
            input_ids,
            labels,
            return_logits=False,
            loss_reduction="sum",
            cu_seqlens=cu_seqlens,
            position_ids=position_ids,
        )
        loss.backward()
        losses.append(loss)
    assert relative_error(losses[1], losses[0]) <= 1e-5
    grads_sparse = dict(sparse.named_parameters())
    for name, param in masked.named_parameters():
        assert relative_error(grads_sparse[name].grad, param.grad) <= 1e-5, name


def test_grouped_dispatch_puts_each_class_in_an_aligned_zero_padded_group() -> None:
    from nedolm.model.morph import GROUP_ALIGN

    classes_T = torch.tensor([2, 0, 2, 2, 0] + [1] * 17)
    route = MorphRoute(classes_T, 3, 8, "grouped")
    T = len(classes_T)
    assert route.grouped_rows == -(-(T + 3 * (GROUP_ALIGN - 1)) // GROUP_ALIGN) * GROUP_ALIGN
    starts = [0, 16, 48]  # class 0: 2 tokens, class 1: 17 tokens -> 32 rows, then class 2
    assert route.group_ends_C.tolist() == [16, 48, route.grouped_rows]
    assert route.group_ends_C.dtype == torch.int32
    for c, start in enumerate(starts):
        tokens = (classes_T == c).nonzero().flatten()  # in token order within the group
        assert route.slot_T[tokens].tolist() == list(range(start, start + len(tokens)))


def test_grouped_dispatch_in_bf16_autocast_matches_masked() -> None:
    """autocast does not cover torch._grouped_mm: the experts cast to autocast's dtype as
    F.linear would, and so equal masked dispatch to bf16 rounding, forward and backward."""
    torch.manual_seed(0)
    results = []
    for dispatch in ("masked", "grouped"):
        torch.manual_seed(0)
        experts = MorphExperts(d_model=32, n_classes=3, expert_dim=16, dispatch=dispatch)
        for param in experts.parameters():
            torch.nn.init.normal_(param, std=0.3)
        torch.manual_seed(1)
        x_TD = torch.randn(50, 32, requires_grad=True)
        classes_T = torch.randint(0, 3, (50,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = experts(x_TD, MorphRoute(classes_T, 3, 16, dispatch))
        assert out.dtype == torch.bfloat16
        out.float().square().sum().backward()
        results.append((out.float(), x_TD.grad, *(p.grad for p in experts.parameters())))
    for got, want in zip(*results, strict=True):
        assert relative_error(got, want) <= 2e-2


def test_grouped_dispatch_compiles_in_bf16_as_one_graph_that_agrees_with_eager() -> None:
    torch.manual_seed(0)
    experts = MorphExperts(d_model=32, n_classes=3, expert_dim=16, dispatch="grouped")
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.3)
    classes_T = torch.randint(0, 3, (50,))

    def run(x_TD: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return experts(x_TD, MorphRoute(classes_T, 3, 16, "grouped"))

    x_TD = torch.randn(50, 32)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(run)(x_TD)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    results = []
    for fn in (run, torch.compile(run, backend="aot_eager", fullgraph=True)):
        x = x_TD.clone().requires_grad_()
        out = fn(x)
        out.float().square().sum().backward()
        results.append((out, x.grad, *(p.grad for p in experts.parameters())))
        experts.zero_grad(set_to_none=True)
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want)


def test_grouped_dispatch_meets_the_gpu_grouped_gemms_layout_rules() -> None:
    """CUDA's grouped GEMM wants bf16 operands whose strides are 16-byte aligned in a row- or
    column-major layout, also for the transposed operands of backward. torch's meta kernel of
    `_grouped_mm` applies the checks of its CUDA kernel, so the dispatch runs here on meta
    tensors (shapes only) at nedolm-0.8b's width, forward and backward."""
    d_model, n_classes, expert_dim, tokens = 1536, 3, 384, 4 * 4096 + 5
    with torch.device("meta"):
        experts = MorphExperts(d_model, n_classes, expert_dim, "grouped")
        x = torch.empty(tokens, d_model, dtype=torch.bfloat16, requires_grad=True)
        route = MorphRoute(torch.empty(tokens, dtype=torch.long), n_classes, expert_dim, "grouped")
    out = experts._grouped(x, route, torch.bfloat16)
    out.sum().backward()
    assert out.shape == x.shape and x.grad is not None
    assert experts.w_down.grad is not None and experts.w_down.grad.shape == (1536, 1152)
    # The checks are live: an operand whose rows are 7 bf16 (14 bytes) apart is refused.
    misaligned = torch.empty(16, 7, dtype=torch.bfloat16, device="meta")
    weights = torch.empty(n_classes, 7, 9, dtype=torch.bfloat16, device="meta")
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        torch._grouped_mm(misaligned, weights, offs=route.group_ends_C)
