"""``TrainState``: the training state a checkpoint carries, and the checkpoint format version.

Each stateful part owns its ``state_dict``/``load_state_dict`` (torchtitan's way): the model,
the optimizer, the schedule ``Progress``, and per rank the torch RNG and the loader cursor
(``SFTLoader.state_dict``). Model, optimizer and progress are equal on every rank and saved
once; RNG and loader state are per rank, gathered to rank 0 as ``ranks[rank]``.

Under FSDP the model and optimizer are saved sharded (``start_sharded_save``, a directory) and the
rest (progress, ranks, stream) rides along as its payload. A checkpoint of either layout
resumes under either mode: a ``.pt`` file's full state is broadcast into FSDP shards
(``load_full_state``), a sharded directory loads into a DDP/single-process model too. The
data stream (``SFTLoader.stream_state_dict``) is global; with ``elastic`` and another
topology the loader re-deals the rest of the epoch from every old rank's cursor.

A checkpoint names its layout in ``format_version``. Version 1 (no ``format_version`` key,
written before ``TrainState`` existed) kept the loader cursor as ``ranks[r]["data_state"]``
with integer keys; ``upgrade_checkpoint`` converts it, and refuses any other version.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nedolm.data.loader import SFTLoader
from nedolm.train.checkpoint import load_checkpoint
from nedolm.train.parallel import is_sharded
from nedolm.train.sharded import (
    ShardedBackground,
    ShardedSave,
    load_full_state,
    load_sharded,
    load_sharded_model,
    read_payload,
    start_sharded_save,
)

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
    schedule_steps: int = 0
    """The steps the lr schedule spans (0: the run's max_steps). Set when a finished run is
    extended: the added steps continue at the learning rate the schedule ended with."""


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
            **self.payload(ranks),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def payload(self, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        """Everything but the model and optimizer (what a sharded checkpoint carries beside)."""
        return {
            "format_version": CHECKPOINT_FORMAT_VERSION,
            "progress": dataclasses.asdict(self.progress),
            "ranks": ranks,
            "data_stream": self.loader.stream_state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], rank: int, *, elastic: bool = False) -> None:
        """Restore a full state (``state_dict``), taking ``rank``'s RNG and loader cursor.

        Before iterating. Under FSDP a collective: the full tensors are scattered to shards,
        and the optimizer state (keyed by parameter index) is renamed to parameter names.
        """
        _check_version(state)
        if is_sharded(self.model):
            optimizer_state = optimizer_state_by_name(
                self.model, self.optimizer, state["optimizer"]
            )
            load_full_state(self.model, self.optimizer, state["model"], optimizer_state)
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.load_payload(state, rank, elastic=elastic)

    def start_sharded_save(
        self,
        directory: Path,
        ranks: list[dict[str, Any]],
        extra: dict,
        *,
        background: ShardedBackground | None = None,
    ) -> ShardedSave:
        """A collective: every rank writes its shards (in the background with
        ``background``); rank 0's seal adds ``payload(ranks)`` + ``extra``."""
        return start_sharded_save(
            directory,
            self.model,
            self.optimizer,
            {"step": self.progress.step},
            {**self.payload(ranks), **extra},
            background=background,
        )

    def load_sharded(
        self, directory: Path, payload: dict[str, Any], rank: int, *, elastic: bool = False
    ) -> None:
        """A collective: restore a sharded checkpoint whose payload is ``payload``."""
        _check_version(payload)
        load_sharded(directory, self.model, self.optimizer)
        self.load_payload(payload, rank, elastic=elastic)

    def load_payload(self, state: dict[str, Any], rank: int, *, elastic: bool) -> None:
        """Progress, this rank's RNG and the loader: its own cursor when the topology is the
        saved one, else (``elastic`` only) the rest of the epoch re-dealt over the new ranks."""
        self.progress = Progress(**state["progress"])
        ranks = state["ranks"]
        stream = state.get("data_stream") or self.loader.stream_state_dict()
        own = ranks[rank]["loader"] if rank < len(ranks) else {}
        if elastic and not self.loader.matches(own, len(ranks)):
            self.loader.load_elastic_state_dict([r["loader"] for r in ranks], stream)
        else:
            self.loader.load_stream_state_dict(stream)
            self.loader.load_state_dict(own)
        # An elastic resume onto more ranks has no saved stream for the new ones.
        torch.set_rng_state(ranks[rank % len(ranks)]["rng"])


def optimizer_state_by_name(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> dict[str, Any]:
    """``optimizer.state_dict()`` of the same model (keyed by parameter index in group order)
    re-keyed by parameter name: the full form ``load_full_state`` takes."""
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {
        "state": {order[int(i)]: value for i, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [order[int(i)] for i in group["params"]]}
            for group in state["param_groups"]
        ],
    }


def read_checkpoint(path: Path, *, verify: bool = True) -> dict[str, Any]:
    """A training checkpoint in the current format: a ``.pt`` file's whole content, or a
    sharded directory's payload (its model and optimizer load with ``load_sharded``).
    ``verify`` as in ``load_checkpoint``.

    Read into memory of its own, not mapped: the optimizer state loaded from it lives as long
    as the job, and a mapping would keep the file's space after rotation deletes it."""
    if Path(path).is_dir():
        return read_payload(path)
    return upgrade_checkpoint(load_checkpoint(path, verify=verify, mmap=False), str(path))


def load_model_weights(path: Path, checkpoint: dict[str, Any], model: nn.Module) -> None:
    """Load a checkpoint's weights into a plain model (export, generation), either layout;
    ``checkpoint`` is ``read_checkpoint(path)``."""
    if Path(path).is_dir():
        load_sharded_model(path, model)
    else:
        model.load_state_dict(checkpoint["model"])


def _check_version(state: dict[str, Any]) -> None:
    if state.get("format_version") != CHECKPOINT_FORMAT_VERSION:
        raise CheckpointFormatError(
            f"training state has format version {state.get('format_version')}, "
            f"expected {CHECKPOINT_FORMAT_VERSION} (run upgrade_checkpoint first)"
        )


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
