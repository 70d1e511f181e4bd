import pytest
import torch
import torch.nn.functional as F

from nedolm.model import IGNORE_INDEX, fused_linear_cross_entropy, packed_layout
from nedolm.model import loss as loss_module


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).detach().norm() / want.detach().norm().clamp_min(1e-30))


def sft_batch(vocab_size: int, seed: int = 0, rows: int = 2, seq_len: int = 40):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (rows, seq_len), generator=gen)
    input_ids[0, 15] = 2
    labels = torch.randint(0, vocab_size, (rows, seq_len), generator=gen)
    labels[torch.rand(rows, seq_len, generator=gen) < 0.6] = IGNORE_INDEX  # 40% targets
    cu_seqlens, position_ids = packed_layout(input_ids, eos_id=2)
    return input_ids, labels, dict(cu_seqlens=cu_seqlens, position_ids=position_ids)


def loss_and_grads(model, input_ids, labels, layout, *, fused, reduction, fp32_logits):
    model.zero_grad(set_to_none=True)
    if fused:
        loss, logits = model(
            input_ids,
            labels,
            return_logits=False,
            loss_reduction=reduction,
            loss_fp32_logits=fp32_logits,
            **layout,
        )
        assert logits is None
    else:  # naive reference: full logits, then the library cross-entropy
        _, logits = model(input_ids, **layout)
        logits = logits.float() if fp32_logits else logits
        loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction=reduction
        )
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("fp32_logits", [True, False])
def test_fused_head_equals_full_logits_cross_entropy(make_model, reduction, fp32_logits) -> None:
    model = make_model()
    batch = sft_batch(model.cfg.vocab_size)
    fused_loss, fused_grads = loss_and_grads(
        model, *batch, fused=True, reduction=reduction, fp32_logits=fp32_logits
    )
    naive_loss, naive_grads = loss_and_grads(
        model, *batch, fused=False, reduction=reduction, fp32_logits=fp32_logits
    )
    assert relative_error(fused_loss, naive_loss) <= 1e-6
    for name, grad in naive_grads.items():
        assert relative_error(fused_grads[name], grad) <= 1e-5, name


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("fp32_logits", [True, False])
def test_bf16_autocast_head_matches_naive_at_bf16_precision(make_model, reduction, fp32_logits):
    model = make_model()
    batch = sft_batch(model.cfg.vocab_size, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        results = [
            loss_and_grads(model, *batch, fused=f, reduction=reduction, fp32_logits=fp32_logits)
            for f in (True, False)
        ]
    (fused_loss, fused_grads), (naive_loss, naive_grads) = results
    # fp32 softmax: the same bf16 logits give the same loss; the gradients may differ by one
    # bf16 rounding (2^-8), since the fused head's chunked bf16 matmuls round at other points
    # than one full-width matmul on some CPUs' kernels (1.8e-3 measured on an AMD EPYC, 0 on
    # an Intel Xeon). A bf16 softmax rounds the loss differently too.
    loss_tol, grad_tol = (1e-5, 2**-8) if fp32_logits else (2e-3, 2e-2)
    assert relative_error(fused_loss, naive_loss) <= loss_tol
    for name, grad in naive_grads.items():
        assert relative_error(fused_grads[name], grad) <= grad_tol, name


def test_chunks_padding_rows_and_no_grad_path() -> None:
    torch.manual_seed(0)
    vocab, padded = 50, 64
    hidden = torch.randn(23, 16, requires_grad=True)
    weight = torch.randn(padded, 16, requires_grad=True)
    targets = torch.randint(0, vocab, (23,))
    # 7 rows per chunk: 4 chunks, the last one short.
    loss = fused_linear_cross_entropy(
        hidden,
        weight,
        targets,
        vocab_size=vocab,
        reduction="sum",
        fp32_logits=True,
        chunk_elements=7 * padded,
    )
    (2.5 * loss).backward()
    hidden_ref = hidden.detach().clone().requires_grad_()
    weight_ref = weight.detach().clone().requires_grad_()
    want = F.cross_entropy(hidden_ref @ weight_ref[:vocab].T, targets, reduction="sum")
    (2.5 * want).backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(hidden.grad, hidden_ref.grad)
    torch.testing.assert_close(weight.grad, weight_ref.grad)
    assert (weight.grad[vocab:] == 0).all()
    with torch.no_grad():
        again = fused_linear_cross_entropy(
            hidden, weight, targets, vocab_size=vocab, reduction="sum", fp32_logits=True
        )
    torch.testing.assert_close(again, want.detach())


@pytest.mark.parametrize("fp32_logits", [True, False])
def test_per_row_losses_equal_the_library_cross_entropy_per_row(fp32_logits) -> None:
    """``reduction="none"``: each row's loss (0 where ignored) over chunks, the last one short,
    as ``F.cross_entropy(reduction="none")``; their sum is the "sum" reduction's."""
    torch.manual_seed(3)
    vocab, padded = 50, 64
    hidden, weight = torch.randn(23, 16), torch.randn(padded, 16)
    targets = torch.randint(0, vocab, (23,))
    targets[[0, 9, 22]] = IGNORE_INDEX
    head = dict(vocab_size=vocab, fp32_logits=fp32_logits, chunk_elements=7 * padded)
    per_row = fused_linear_cross_entropy(hidden, weight, targets, reduction="none", **head)
    want = F.cross_entropy(hidden @ weight[:vocab].T, targets, reduction="none")
    assert per_row.shape == (23,) and per_row.dtype == torch.float32
    torch.testing.assert_close(per_row, want)
    assert (per_row[[0, 9, 22]] == 0).all()
    summed = fused_linear_cross_entropy(hidden, weight, targets, reduction="sum", **head)
    torch.testing.assert_close(per_row.sum(), summed)


def test_per_row_losses_have_no_gradient_and_come_from_the_fused_head(make_model) -> None:
    """A loss per row cannot be scaled after the fact into the weight gradient the head forms
    in forward: asked for with gradients, it is refused, as it is from the full-logits path;
    under no_grad the model returns one loss per scored row."""
    model = make_model()
    input_ids, labels, layout = sft_batch(model.cfg.vocab_size, seed=4)
    with pytest.raises(ValueError, match=r"'none'.*no gradient.*torch\.no_grad"):
        model(input_ids, labels, return_logits=False, loss_reduction="none", **layout)
    with torch.no_grad():
        with pytest.raises(ValueError, match="with return_logits"):
            model(input_ids, labels, loss_reduction="none", **layout)
        per_row, _ = model(input_ids, labels, return_logits=False, loss_reduction="none", **layout)
        summed, _ = model(input_ids, labels, return_logits=False, loss_reduction="sum", **layout)
    assert per_row.shape == ((labels != IGNORE_INDEX).sum(),)
    torch.testing.assert_close(per_row.sum(), summed)


@pytest.mark.parametrize(
    ("dtype", "slice_rows"),
    [(torch.float32, 8192), (torch.bfloat16, 8192), (torch.bfloat16, 24)],  # 24: 3 slices
)
def test_weight_gradient_is_added_into_the_float32_accumulator(monkeypatch, dtype, slice_rows):
    """Each chunk adds grad.T @ h into the float32 accumulator: one in-place GEMM in float32,
    or, for bf16 where no GEMM writes float32 (this CPU), bf16 products a slice at a time."""
    monkeypatch.setattr(loss_module, "GRAD_WEIGHT_SLICE_ROWS", slice_rows)
    gen = torch.Generator().manual_seed(0)
    accumulator = torch.randn(64, 16, generator=gen)
    grad_CW = torch.randn(7, 64, generator=gen).to(dtype)
    h_CD = torch.randn(7, 16, generator=gen).to(dtype)
    want = accumulator.double() + grad_CW.double().T @ h_CD.double()
    loss_module.add_weight_grad(accumulator, grad_CW, h_CD)
    assert accumulator.dtype == torch.float32
    tolerance = 1e-6 if dtype == torch.float32 else 2**-8  # the bf16 product's rounding
    assert relative_error(accumulator.double(), want) <= tolerance


def skip_unless_meta_checks_float32_output_addmm() -> None:
    """torch 2.10's meta tensors run `addmm(out_dtype=)` through plain addmm's decomposition,
    which takes the dtype for `beta` (TypeError): its rules cannot be checked there (2.13's
    can; CUDA runs its own kernel either way, behind the `has_float32_output_gemm` probe)."""
    ones = torch.empty(2, 2, dtype=torch.bfloat16, device="meta")
    accumulator = torch.empty(2, 2, dtype=torch.float32, device="meta")
    try:
        torch.addmm(accumulator, ones, ones, out_dtype=torch.float32, out=accumulator)
    except TypeError as error:
        pytest.skip(f"torch {torch.__version__}'s meta addmm(out_dtype=) is broken: {error}")


def test_the_float32_output_gemm_that_cuda_runs_is_a_valid_in_place_call() -> None:
    """CUDA adds bf16 products into the float32 accumulator with `addmm(out_dtype=float32)`,
    which this CPU lacks (the probe says so, and the slices run instead); torch's shape and
    dtype rules for that call are checked here on meta tensors."""
    assert loss_module.has_float32_output_gemm("cpu") is False
    skip_unless_meta_checks_float32_output_addmm()
    accumulator = torch.empty(64, 16, dtype=torch.float32, device="meta")
    grad_CW = torch.empty(7, 64, dtype=torch.bfloat16, device="meta")
    h_CD = torch.empty(7, 16, dtype=torch.bfloat16, device="meta")
    out = torch.addmm(accumulator, grad_CW.T, h_CD, out_dtype=torch.float32, out=accumulator)
    assert out is accumulator and out.shape == (64, 16) and out.dtype == torch.float32


@pytest.mark.parametrize("fp32_logits", [True, False])
def test_the_chunk_loop_cuda_runs_passes_torchs_shape_and_dtype_checks(monkeypatch, fp32_logits):
    """The whole chunk loop on meta tensors (torch's shape and dtype rules, no data), taking the
    float32-output GEMM that CUDA takes: every op CUDA will run accepts its arguments."""
    skip_unless_meta_checks_float32_output_addmm()
    monkeypatch.setattr(loss_module, "has_float32_output_gemm", lambda device_type: True)
    hidden = torch.empty(23, 16, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(64, 16, dtype=torch.bfloat16, device="meta")
    targets = torch.empty(23, dtype=torch.long, device="meta")
    loss, grad_hidden, grad_weight = loss_module._chunked_loss(
        hidden, weight, targets, 50, "mean", fp32_logits, 7, True
    )
    assert loss.shape == () and loss.dtype == torch.float32
    assert grad_hidden.shape == (23, 16) and grad_hidden.dtype == torch.bfloat16
    assert grad_weight.shape == (64, 16) and grad_weight.dtype == torch.float32


def head_gradients(head, hidden, weight, targets) -> tuple[torch.Tensor, ...]:
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    loss = head(hidden, weight, targets)
    (0.37 * loss).backward()  # a scale other than 1: backward scales the gradients in place
    return loss.detach(), hidden.grad, weight.grad


def test_in_place_backward_compiles_and_refuses_a_second_backward() -> None:
    """The gradients backward scales in place: compiled equals eager, and retain_graph cannot
    scale them twice (autograd's saved-tensor version check raises instead)."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(30, 16), torch.randn(64, 16)
    targets = torch.randint(0, 50, (30,))

    def head(h, w, t):
        return fused_linear_cross_entropy(
            h, w, t, vocab_size=50, reduction="mean", fp32_logits=True, chunk_elements=8 * 64
        )

    eager = head_gradients(head, hidden, weight, targets)
    compiled = head_gradients(torch.compile(head, backend="inductor"), hidden, weight, targets)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want)
    h = hidden.clone().requires_grad_()
    loss = head(h, weight, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_no_targets_sum_to_zero_and_bad_reduction_is_refused(make_model) -> None:
    model = make_model()
    input_ids = torch.randint(0, model.cfg.vocab_size, (1, 8))
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    loss, _ = model(input_ids, labels, return_logits=False, loss_reduction="sum")
    loss.backward()
    assert loss.item() == 0.0
    with pytest.raises(ValueError, match="loss_reduction"):
        model(input_ids, labels, return_logits=False, loss_reduction="avg")
    with pytest.raises(ValueError, match="nothing to compute"):
        model(input_ids, return_logits=False)


def test_checkpointed_blocks_equal_plain_blocks(make_model) -> None:
    model = make_model()
    batch = sft_batch(model.cfg.vocab_size, seed=2)
    plain = loss_and_grads(model, *batch, fused=True, reduction="sum", fp32_logits=True)
    model.grad_checkpoint = True
    checkpointed = loss_and_grads(model, *batch, fused=True, reduction="sum", fp32_logits=True)
    torch.testing.assert_close(checkpointed[0], plain[0], atol=0, rtol=1e-6)
    for name, grad in plain[1].items():
        torch.testing.assert_close(checkpointed[1][name], grad, atol=1e-7, rtol=1e-6)


def test_padded_target_index_rows_add_nothing(make_model) -> None:
    """Training pads the target positions with -1 rows to fixed multiples (static shapes for
    torch.compile): the loss and every gradient equal those of the unpadded positions."""
    model = make_model()
    input_ids, labels, layout = sft_batch(model.cfg.vocab_size, seed=3)
    positions = (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
    padded = torch.cat([positions, torch.full((13,), -1)])[torch.randperm(len(positions) + 13)]
    results = []
    for target_index in (None, padded):
        for reduction in ("sum", "mean"):
            model.zero_grad(set_to_none=True)
            loss, _ = model(
                input_ids,
                labels,
                return_logits=False,
                loss_reduction=reduction,
                target_index=target_index,
                **layout,
            )
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    for (want_loss, want_grads), (loss, grads) in zip(results[:2], results[2:], strict=True):
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
        for grad, want in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)  # row order
