import pytest
import torch

from nedolm.model import packed_layout
from nedolm.model.layout import positions_from_cu_seqlens

EOS = 2


def slow_layout(input_ids: torch.Tensor, eos_id: int) -> tuple[list[int], list[list[int]]]:
    """Token-by-token reading of the rule: a row start or the token after an EOS starts a segment."""
    starts, positions = [], []
    for row_index, row in enumerate(input_ids.tolist()):
        row_positions = []
        for col, _ in enumerate(row):
            if col == 0 or row[col - 1] == eos_id:
                starts.append(row_index * len(row) + col)
                row_positions.append(0)
            else:
                row_positions.append(row_positions[-1] + 1)
        positions.append(row_positions)
    return [*starts, input_ids.numel()], positions


@pytest.mark.parametrize("seed", range(6))
def test_packed_layout_matches_the_rule(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 6, (3, 17), generator=gen)  # EOS (2) is frequent
    cu_seqlens, position_ids = packed_layout(input_ids, EOS)
    want_cu, want_pos = slow_layout(input_ids, EOS)
    assert cu_seqlens.dtype == torch.int32
    assert cu_seqlens.tolist() == want_cu
    assert position_ids.tolist() == want_pos
    assert positions_from_cu_seqlens(cu_seqlens, input_ids.numel()).view(3, 17).equal(position_ids)


def test_eos_ends_a_segment_and_trailing_eos_adds_none() -> None:
    input_ids = torch.tensor([[5, 6, EOS, 7, EOS], [EOS, 8, 9, 9, 9]])
    cu_seqlens, position_ids = packed_layout(input_ids, EOS)
    assert cu_seqlens.tolist() == [0, 3, 5, 6, 10]
    assert position_ids.tolist() == [[0, 1, 2, 0, 1], [0, 0, 1, 2, 3]]


def test_bad_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        packed_layout(torch.tensor([1, 2, 3]), EOS)
