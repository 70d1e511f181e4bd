"""``TrainState``: the training state a checkpoint carries, and the checkpoint format version.

Each stateful part owns its ``state_dict``/``load_state_dict`` (torchtitan's way): the model,
the optimizer, the schedule ``Progress``, and per rank the torch RNG and the loader cursor
(``SFTLoader.state_dict``). Model, optimizer and progress are equal on every rank and saved
once; RNG and loader state are per rank, gathered to rank 0 as ``ranks[rank]``.

A checkpoint names its layout in ``format_version``. Version 1 (no ``format_version`` key,
written before ``TrainState`` existed) kept the loader cursor as ``ranks[r]["data_state"]``
with integer keys; ``upgrade_checkpoint`` converts it, and refuses any other version.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nedolm.data.loader import SFTLoader

CHECKPOINT_FORMAT_VERSION = 2
_LEGACY_FORMAT_VERSION = 1


class CheckpointFormatError(RuntimeError):
    """A checkpoint written in a layout this trainer cannot read."""


@dataclass
class Progress:
    """Where the schedule stands: optimizer steps taken and tokens trained on."""

    step: int = 0
    context_tokens_seen: int = 0
    assistant_tokens_seen: int = 0


class TrainState:
    """Model, optimizer, progress, RNG and loader cursor: what a resume must restore exactly.

    ``model`` is the bare module (not the compiled or DDP wrapper), so its keys never change.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: SFTLoader,
        progress: Progress | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loader = loader
        self.progress = progress or Progress()

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's own part: its RNG stream and its loader cursor."""
        return {"rng": torch.get_rng_state(), "loader": self.loader.state_dict()}

    def state_dict(self, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole state, given every rank's ``rank_state_dict`` in rank order."""
        return {
            "format_version": CHECKPOINT_FORMAT_VERSION,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "progress": dataclasses.asdict(self.progress),
            "ranks": ranks,
        }

    def load_state_dict(self, state: dict[str, Any], rank: int) -> None:
        """Restore everything, taking ``rank``'s RNG and loader cursor; before iterating."""
        if state.get("format_version") != CHECKPOINT_FORMAT_VERSION:
            raise CheckpointFormatError(
                f"training state has format version {state.get('format_version')}, "
                f"expected {CHECKPOINT_FORMAT_VERSION} (run upgrade_checkpoint first)"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.progress = Progress(**state["progress"])
        local = state["ranks"][rank]
        torch.set_rng_state(local["rng"])
        self.loader.load_state_dict(local["loader"])


def upgrade_checkpoint(state: dict[str, Any], path: str) -> dict[str, Any]:
    """``state`` in the current format: version 1 is converted, unknown versions refused."""
    version = state.get("format_version", _LEGACY_FORMAT_VERSION)
    if version == CHECKPOINT_FORMAT_VERSION:
        return state
    if version != _LEGACY_FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{path} has checkpoint format version {version}; this trainer reads version "
            f"{CHECKPOINT_FORMAT_VERSION} and converts version {_LEGACY_FORMAT_VERSION}"
        )
    if "ranks" not in state or any("data_state" not in r for r in state["ranks"]):
        raise CheckpointFormatError(
            f"{path} has no format_version and is not a version {_LEGACY_FORMAT_VERSION} "
            "training checkpoint (no ranks[].data_state): cannot resume from it"
        )
    ranks = [
        {
            "rng": r["rng"],
            "loader": {str(k): [int(v) for v in row] for k, row in r["data_state"].items()},
        }
        for r in state["ranks"]
    ]
    return {**state, "format_version": CHECKPOINT_FORMAT_VERSION, "ranks": ranks}
