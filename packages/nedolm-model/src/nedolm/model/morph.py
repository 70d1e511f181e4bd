"""Morph routing: one small SwiGLU expert per morph class of the input token.

Turkish words are a root followed by suffixes, so word-initial pieces, continuation (suffix)
pieces and everything else get separate expert capacity. `masked` dispatch runs every expert
on every token and keeps the right one by a mask (static shapes, compiles without graph breaks);
`sparse` gathers each class's tokens, runs only that expert and scatters back (fewer FLOPs, host
sync for the class counts); `grouped` copies the tokens into class groups of a fixed-size buffer
and runs each expert on its group only, three grouped GEMMs (`torch._grouped_mm`) with the group
offsets on the device: the FLOPs of `sparse` with the static shapes of `masked`, in bf16 (the
dtype torch's grouped GEMM takes; in other dtypes `grouped` computes the masked way). All three
compute the same function.
"""

# Shape legend: T tokens, D model dim, C morph classes, E expert hidden dim, P grouped rows.
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WORD_INITIAL, CONTINUATION, OTHER = 0, 1, 2
N_VOCAB_MORPH_CLASSES = 3  # classes produced by morph_classes_from_vocab
_WORD_START = "\u2581"  # SentencePiece's word-boundary marker "▁"
GROUP_ALIGN = 16  # grouped dispatch: each class group starts at a multiple of this many rows


def morph_classes_from_vocab(pieces: Sequence[str]) -> Tensor:
    """Morph class of each vocabulary piece, by its surface form.

    The rule: a piece that is "▁" followed by letters only is WORD_INITIAL (0); a piece made of
    letters only is CONTINUATION (1), i.e. a suffix or the rest of a word; everything else is
    OTHER (2): digits, punctuation, mixed pieces, a bare "▁", byte pieces and control or special
    tokens such as "<s>" or "<|mesaj_basla|>". Ids beyond `len(pieces)` (control ids appended
    after the tokenizer, pad) become OTHER when the model pads the table.

    Returns:
        int64 [len(pieces)] classes.
    """
    classes = [_piece_class(piece) for piece in pieces]
    return torch.tensor(classes, dtype=torch.long)


def _piece_class(piece: str) -> int:
    if piece.startswith(_WORD_START) and piece[1:].isalpha():
        return WORD_INITIAL
    if piece.isalpha():
        return CONTINUATION
    return OTHER


class MorphExperts(nn.Module):
    """Per-class SwiGLU experts stored as one stacked weight each, in nn.Linear layout."""

    def __init__(self, d_model: int, n_classes: int, expert_dim: int, dispatch: str) -> None:
        super().__init__()
        self.n_classes, self.expert_dim, self.dispatch = n_classes, expert_dim, dispatch
        # Rows c*E:(c+1)*E of w_gate/w_up and columns of w_down belong to expert c.
        self.w_gate = nn.Parameter(torch.empty(n_classes * expert_dim, d_model))
        self.w_up = nn.Parameter(torch.empty(n_classes * expert_dim, d_model))
        self.w_down = nn.Parameter(torch.empty(d_model, n_classes * expert_dim))

    def forward(self, x_TD: Tensor, route: MorphRoute) -> Tensor:
        if self.dispatch == "masked":
            return self._masked(x_TD, route.mask_TCE)
        if self.dispatch == "grouped":
            dtype = x_TD.dtype
            if torch.is_autocast_enabled(x_TD.device.type):  # autocast skips _grouped_mm
                dtype = torch.get_autocast_dtype(x_TD.device.type)
            if dtype == torch.bfloat16:
                return self._grouped(x_TD, route, dtype)
            # torch._grouped_mm is bf16-only (its compiled form and its GPU kernels).
            return self._masked(x_TD, route.one_hot_TC.repeat_interleave(self.expert_dim, dim=1))
        out_TD = torch.zeros_like(x_TD)
        E = self.expert_dim
        for c, index in enumerate(route.class_indices):
            if index.numel() == 0:
                continue
            rows = slice(c * E, (c + 1) * E)
            x_tD = x_TD[index]
            hidden = F.silu(F.linear(x_tD, self.w_gate[rows])) * F.linear(x_tD, self.w_up[rows])
            out_TD = out_TD.index_add(0, index, F.linear(hidden, self.w_down[:, rows]))
        return out_TD

    def _masked(self, x_TD: Tensor, mask_TCE: Tensor) -> Tensor:
        hidden_TCE = F.silu(F.linear(x_TD, self.w_gate)) * F.linear(x_TD, self.w_up)
        return F.linear(hidden_TCE * mask_TCE.to(hidden_TCE.dtype), self.w_down)

    def _grouped(self, x_TD: Tensor, route: MorphRoute, dtype: torch.dtype) -> Tensor:
        """Every expert on its own class group, in `dtype` (what autocast gives a linear)."""
        C, E, D = self.n_classes, self.expert_dim, x_TD.size(1)
        x_PD = x_TD.new_zeros(route.grouped_rows, D, dtype=dtype)
        x_PD = x_PD.index_copy(0, route.slot_T, x_TD.to(dtype))
        ends_C = route.group_ends_C
        # Expert c's weights as [C, in, out] views of per-expert [out, in] blocks (each group's
        # matrix column-major, as grouped GEMMs take it): rows c*E:(c+1)*E of w_gate/w_up, and
        # columns c*E:(c+1)*E of w_down, made contiguous per expert first.
        gate_PE = torch._grouped_mm(x_PD, self.w_gate.to(dtype).view(C, E, D).mT, offs=ends_C)
        up_PE = torch._grouped_mm(x_PD, self.w_up.to(dtype).view(C, E, D).mT, offs=ends_C)
        w_down_CDE = self.w_down.view(D, C, E).transpose(0, 1).to(dtype).contiguous()
        out_PD = torch._grouped_mm(F.silu(gate_PE) * up_PE, w_down_CDE.mT, offs=ends_C)
        return out_PD.index_select(0, route.slot_T)


class MorphRoute:
    """Which expert each token uses, computed once per forward and shared by every block."""

    def __init__(self, classes_T: Tensor, n_classes: int, expert_dim: int, dispatch: str) -> None:
        self.mask_TCE = torch.empty(0)
        self.class_indices: list[Tensor] = []
        self.one_hot_TC = self.slot_T = self.group_ends_C = torch.empty(0)
        self.grouped_rows = 0
        if dispatch in ("masked", "grouped"):
            # A comparison, not F.one_hot: its range check reads the classes on the host.
            self.one_hot_TC = classes_T[:, None] == torch.arange(n_classes, device=classes_T.device)
        if dispatch == "masked":
            self.mask_TCE = self.one_hot_TC.repeat_interleave(expert_dim, dim=1)
        elif dispatch == "grouped":
            self.slot_T, self.group_ends_C, self.grouped_rows = _group_slots(
                classes_T, self.one_hot_TC
            )
        else:
            self.class_indices = [(classes_T == c).nonzero().flatten() for c in range(n_classes)]


def _group_slots(classes_T: Tensor, one_hot_TC: Tensor) -> tuple[Tensor, Tensor, int]:
    """Each token's row in a buffer of class groups: (slot [T], group end offsets [C] int32,
    buffer rows P).

    Tokens keep their order within a group; every group starts at a multiple of GROUP_ALIGN
    rows (grouped GEMMs on a GPU want aligned starts, also for the weight gradient, whose
    reduction runs along the rows) and the last group ends at P = T + C * (GROUP_ALIGN - 1)
    rounded up, a size that does not depend on the classes; padding rows stay zero. All of
    it on the device: nothing waits for the class counts.
    """
    T, n_classes = one_hot_TC.shape
    counts_C = one_hot_TC.sum(0)
    padded_C = (counts_C + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    starts_C = padded_C.cumsum(0) - padded_C
    rank_T = one_hot_TC.cumsum(0).gather(1, classes_T[:, None]).squeeze(1) - 1
    slot_T = starts_C[classes_T] + rank_T
    rows = -(-(T + n_classes * (GROUP_ALIGN - 1)) // GROUP_ALIGN) * GROUP_ALIGN
    ends_C = torch.cat((starts_C[1:], starts_C.new_full((1,), rows))).to(torch.int32)
    return slot_T, ends_C, rows
