"""``generate``/``chat``/``export`` read a run's model only: the optimizer state of its
checkpoint is never read (damage there does not matter, a full read would refuse it), damage in
the model is refused naming the file, and nothing of the checkpoint stays mapped or open."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

from nedolm.train.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from nedolm.train.testing import SMALL_BASE, LaunchedJob, init_tiny_base, write_stop_test_config
from nedolm_sft.chat_model import Placement, load_chat_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """A 2-step SFT run with one checkpoint (optimizer state included)."""
    root = tmp_path_factory.mktemp("generate-load")
    base = init_tiny_base(root / "base", corpus, {**SMALL_BASE, "max_seq_len": 256}, seed=1)
    config = write_stop_test_config(root / "run.yaml", corpus, base, max_steps=2)
    cmd = [sys.executable, "-m", "nedolm_sft", "run", str(config), "--no-compile"]
    LaunchedJob(cmd, config).wait_ok()
    return config.with_suffix("")


def _flip_inside(path: Path, tensor: torch.Tensor) -> None:
    """Flip one byte inside ``tensor``'s bytes in the file ``path``."""
    data = bytearray(path.read_bytes())
    raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    at = data.find(raw)
    assert at > 0 and data.find(raw, at + 1) == -1, "the tensor's bytes are not unique"
    data[at + len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _held(path: Path) -> list[str]:
    maps = Path("/proc/self/maps").read_text().splitlines()
    fds = [str(p.readlink()) for p in Path("/proc/self/fd").iterdir() if p.is_symlink()]
    return [line for line in maps + fds if str(path.parent) in line]


def test_generate_reads_the_model_only_and_keeps_nothing_mapped(
    trained: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    [(_, source)] = list_checkpoints(trained)
    path = run_dir / "checkpoints" / source.name
    path.write_bytes(source.read_bytes())  # no sidecar: the digests inside the file are used
    state = load_checkpoint(path, mmap=False)
    exp_avg = next(iter(state["optimizer"]["state"].values()))["exp_avg"]
    weight = state["model"]["tok_embeddings.weight"]
    del state

    _flip_inside(path, exp_avg)
    with pytest.raises(CheckpointError, match="is corrupt"):
        load_checkpoint(path)  # a resume reads everything and refuses it
    chat = load_chat_model(run_dir)  # generate's load: the model alone, still intact
    assert chat.source == path and torch.equal(chat.model.tok_embeddings.weight, weight)
    assert _held(path) == []

    _flip_inside(path, weight)
    with pytest.raises(CheckpointError, match=re.escape(f"{path} is corrupt: model tensors")):
        load_chat_model(run_dir)
    assert _held(path) == []


@pytest.mark.parametrize("kind", ["sft run", "base run"])
def test_a_model_loaded_in_half_precision_has_the_checkpoint_rounded(
    trained: Path, corpus: Path, kind: str
) -> None:
    """``generate --dtype bfloat16`` (the default on a GPU) copies the mapped float32 weights
    straight into a bf16 model on its device: bit for bit the model that loading in float32 and
    rounding gave, buffers included."""
    path, data_dir = (trained, None) if kind == "sft run" else (trained.parent / "base", corpus)
    rounded = load_chat_model(path, data_dir).model.to(torch.bfloat16)
    half = Placement(torch.device("cpu"), torch.bfloat16)
    direct = load_chat_model(path, data_dir, half).model
    want = {**dict(rounded.named_parameters()), **dict(rounded.named_buffers())}
    got = {**dict(direct.named_parameters()), **dict(direct.named_buffers())}
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert direct.tok_embeddings.weight.dtype == torch.bfloat16
    # Built where it will run (the meta device standing in for a GPU; loading copies nothing).
    meta = Placement(torch.device("meta"), torch.bfloat16)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*to a meta parameter in the current model")
        elsewhere = load_chat_model(path, data_dir, meta)
    assert {p.device.type for p in elsewhere.model.parameters()} == {"meta"}
