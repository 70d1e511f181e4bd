"""The flex backend: one document block mask per forward, exact isolation (CPU: forward only)."""

import itertools

import pytest
import torch

from nedolm.model import resolve_attn_impl
from nedolm.model.attention import build_layout, varlen_attention
from nedolm.model.flex import BLOCK, document_block_mask

LAYOUTS = [
    [5, 1, 9, 30, 2, 7, 7, 100],  # 161 tokens: a partly filled second block
    [128, 128],  # segments exactly on block edges
    [300],  # one segment over three blocks: full blocks below the diagonal
    [3] * 90 + [1],  # many short segments
    [200, 1, 55, 130],
]


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def allowed_pairs(lengths: list[int]) -> torch.Tensor:
    """[T, T]: query i may see key j (same segment, j <= i), built one segment at a time."""
    total = sum(lengths)
    allowed = torch.zeros(total, total, dtype=torch.bool)
    for start, end in itertools.pairwise(cu_seqlens_of(lengths).tolist()):
        allowed[start:end, start:end] = torch.ones(end - start, end - start).tril().bool()
    return allowed


def block_sets(counts: torch.Tensor, indices: torch.Tensor) -> set[tuple[int, int]]:
    return {
        (q_block, int(indices[0, 0, q_block, i]))
        for q_block in range(counts.size(-1))
        for i in range(int(counts[0, 0, q_block]))
    }


@pytest.mark.parametrize("lengths", LAYOUTS)
def test_block_mask_matches_the_token_mask_block_by_block(lengths: list[int]) -> None:
    total = sum(lengths)
    mask = document_block_mask(cu_seqlens_of(lengths), total)
    allowed = allowed_pairs(lengths)
    n_blocks = -(-total // BLOCK)
    padded = torch.zeros(n_blocks * BLOCK, n_blocks * BLOCK, dtype=torch.bool)
    padded[:total, :total] = allowed
    tiles = padded.view(n_blocks, BLOCK, n_blocks, BLOCK).transpose(1, 2)
    any_pair, all_pairs = tiles.any((-1, -2)), tiles.all(-1).all(-1)
    want_full = {tuple(ij) for ij in all_pairs.nonzero().tolist()}
    want_partial = {tuple(ij) for ij in (any_pair & ~all_pairs).nonzero().tolist()}
    assert block_sets(mask.full_kv_num_blocks, mask.full_kv_indices) == want_full
    assert block_sets(mask.kv_num_blocks, mask.kv_indices) == want_partial
    q_idx, kv_idx = torch.arange(total)[:, None], torch.arange(total)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    assert torch.equal(mask.mask_mod(zero, zero, q_idx, kv_idx), allowed)


@pytest.mark.parametrize("lengths", LAYOUTS)
def test_flex_forward_equals_the_sdpa_reference(lengths: list[int]) -> None:
    torch.manual_seed(0)
    total = sum(lengths)
    cu_seqlens = cu_seqlens_of(lengths)
    q, k, v = torch.randn(total, 4, 16), torch.randn(total, 2, 16), torch.randn(total, 2, 16)
    got = varlen_attention(q, k, v, build_layout("flex", cu_seqlens, None, total))
    want = varlen_attention(q, k, v, build_layout("sdpa", cu_seqlens, None, total))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_one_mask_per_forward_and_one_flex_call_per_layer(monkeypatch, make_model) -> None:
    from nedolm.model import attention

    masks, calls = [], []

    def counted_mask(*args):
        masks.append(document_block_mask(*args))
        return masks[-1]

    def counted_flex(q, k, v, block_mask):
        calls.append(block_mask)
        return flex_varlen(q, k, v, block_mask)

    flex_varlen = attention.flex_varlen
    resolve_attn_impl("flex", "cpu", backward=False)  # its start-up probe builds masks too
    monkeypatch.setattr(attention, "document_block_mask", counted_mask)
    monkeypatch.setattr(attention, "flex_varlen", counted_flex)
    model = make_model(attn_impl="flex", n_layers=3).eval()
    input_ids = torch.randint(3, model.cfg.vocab_size, (2, 40))
    with torch.no_grad():
        model(input_ids, cu_seqlens=torch.tensor([0, 7, 40, 41, 80], dtype=torch.int32))
    assert len(masks) == 1
    assert len(calls) == 3 and all(mask is masks[0] for mask in calls)


def test_compiled_flex_reuses_its_graph_for_new_packings() -> None:
    """Mask building and the flex call trace once; new packings are new tensor values only."""

    def attend(q, k, v, cu_seqlens):
        return varlen_attention(q, k, v, build_layout("flex", cu_seqlens, None, q.size(0)))

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="eager")
    graphs = []
    for lengths in ([5, 1, 9, 30, 255], [100, 100, 50, 40, 10], [150, 150], [3] * 100):
        total = sum(lengths)
        cu_seqlens = cu_seqlens_of(lengths)
        q, k, v = torch.randn(total, 4, 16), torch.randn(total, 2, 16), torch.randn(total, 2, 16)
        with torch.no_grad():
            got = compiled(q, k, v, cu_seqlens)
            want = varlen_attention(q, k, v, build_layout("sdpa", cu_seqlens, None, total))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    # The second packing has the first's segment count: no recompile; the third's new count
    # makes that dimension dynamic once; the fourth reuses it.
    assert graphs[0] == graphs[1] and graphs[2] == graphs[3], graphs


def test_compiled_blocks_trace_flex_once_for_every_packing(make_model) -> None:
    """The trainer's way: the mask is built outside the compiled blocks, once per micro-batch,
    and each block gets a new BlockMask (new tensors, a new mask_mod closure) of the same
    shapes. Dynamo must not guard on those objects' identity, or every micro-batch would
    recompile. Forward only (no CPU backward); guards are the forward frame's either way."""
    from torch._dynamo.utils import counters

    model = make_model(attn_impl="flex", max_seq_len=160).train()  # train mode: compiled blocks
    reference = make_model(attn_impl="sdpa", max_seq_len=160).train()
    reference.load_state_dict(model.state_dict())
    resolve_attn_impl("flex", "cpu", backward=False)
    torch._dynamo.reset()
    counters.clear()
    model.compile_blocks(backend="aot_eager")
    packings = [  # (row 1, row 2) of 160 tokens each: 2 to 52 segments
        ([5, 1, 9, 30, 2, 7, 6, 100], [160]),
        ([80, 80], [40, 120]),
        ([3] * 50 + [10], [1, 159]),
        ([128, 32], [1] * 10 + [150]),
    ]
    for first_row, second_row in packings:
        cu_seqlens = cu_seqlens_of([*first_row, *second_row])
        input_ids = torch.randint(3, model.cfg.vocab_size, (2, 160))
        with torch.no_grad():
            got = model(input_ids, cu_seqlens=cu_seqlens)
            want = reference(input_ids, cu_seqlens=cu_seqlens)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert dict(counters["graph_break"]) == {}
    assert counters["frames"]["ok"] == 1, f"{counters['frames']['ok']} frames: recompiles"
