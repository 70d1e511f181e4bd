"""Morph routing: one small SwiGLU expert per morph class of the input token.

Turkish words are a root followed by suffixes, so word-initial pieces, continuation (suffix)
pieces and everything else get separate expert capacity. `masked` dispatch runs every expert
on every token and keeps the right one by a mask (static shapes, compiles without graph breaks);
`sparse` gathers each class's tokens, runs only that expert and scatters back (fewer FLOPs, host
sync for the class counts). Both compute the same function.
"""

# Shape legend: T tokens, D model dim, C morph classes, E expert hidden dim.
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WORD_INITIAL, CONTINUATION, OTHER = 0, 1, 2
N_VOCAB_MORPH_CLASSES = 3  # classes produced by morph_classes_from_vocab
_WORD_START = "\u2581"  # SentencePiece's word-boundary marker "▁"


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
            hidden_TCE = F.silu(F.linear(x_TD, self.w_gate)) * F.linear(x_TD, self.w_up)
            return F.linear(hidden_TCE * route.mask_TCE.to(hidden_TCE.dtype), self.w_down)
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


class MorphRoute:
    """Which expert each token uses, computed once per forward and shared by every block."""

    def __init__(self, classes_T: Tensor, n_classes: int, expert_dim: int, dispatch: str) -> None:
        self.mask_TCE = torch.empty(0)
        self.class_indices: list[Tensor] = []
        if dispatch == "masked":
            # A comparison, not F.one_hot: its range check reads the classes on the host.
            one_hot_TC = classes_T[:, None] == torch.arange(n_classes, device=classes_T.device)
            self.mask_TCE = one_hot_TC.repeat_interleave(expert_dim, dim=1)
        else:
            self.class_indices = [(classes_T == c).nonzero().flatten() for c in range(n_classes)]
