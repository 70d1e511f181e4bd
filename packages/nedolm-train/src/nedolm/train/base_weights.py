"""Where a base run keeps its weights, and reading them: a checkpoint or a safetensors file.

Besides ``checkpoints/step-*.pt`` (what ``init-base`` and pretraining jobs write), a base run
may hold its MorphTransformer state dict as one ``model.safetensors`` file, in any float dtype:
the pretrained base shipped with the app does, because safetensors is small (bf16 storage),
needs no pickle to read and is what every weight-sharing tool understands. ``load_state_dict``
casts the stored tensors to the model's dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from nedolm.train.checkpoint import CheckpointError, newest_model_checkpoint, read_model_checkpoint

SAFETENSORS_WEIGHTS = "model.safetensors"


def base_weights_file(base_run_dir: Path) -> Path | None:
    """The newest ``checkpoints/step-*.pt`` of ``base_run_dir``, else its ``model.safetensors``."""
    newest = newest_model_checkpoint(base_run_dir)  # only its model is read and verified
    if newest is not None:
        return newest[0]
    weights = Path(base_run_dir) / SAFETENSORS_WEIGHTS
    return weights if weights.is_file() else None


def load_base_state(path: Path) -> dict[str, torch.Tensor]:
    """The model state dict stored at ``path`` (``*.safetensors`` or a NedoLM checkpoint).

    Raises:
        CheckpointError: the file cannot be read; the message names it.
    """
    if Path(path).suffix != ".safetensors":
        return read_model_checkpoint(path)["model"]  # mapped; the caller copies it out
    try:
        return load_file(path)
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read base weights {path}: {exc}") from exc
