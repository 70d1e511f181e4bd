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


def read_base_weights(
    base_run_dir: Path, explicit: Path | None = None
) -> tuple[Path, dict[str, torch.Tensor]]:
    """The base's weights file and its model state dict, each file read once: ``explicit`` if
    given, else the newest ``checkpoints/step-*.pt`` whose model verifies (only the model is
    read), else ``model.safetensors``. A checkpoint's tensors are mapped: copy them out
    (``load_state_dict``) and drop the dict.

    Raises:
        FileNotFoundError: no weights, naming both places (or the missing explicit file).
        CheckpointError: the file cannot be read; the message names it.
    """
    if explicit is not None:
        if not Path(explicit).is_file():
            raise FileNotFoundError(f"base checkpoint {explicit} does not exist")
        return explicit, load_base_state(explicit)
    newest = newest_model_checkpoint(base_run_dir)
    if newest is not None:
        return newest[0], newest[1]["model"]
    weights = Path(base_run_dir) / SAFETENSORS_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(
            f"no base checkpoint under {base_run_dir}/checkpoints and no "
            f"{base_run_dir}/{SAFETENSORS_WEIGHTS}"
        )
    return weights, load_base_state(weights)


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
