"""Cross-package fixtures: a real corpus from the app's shipped sample and a trained dense run.

The run is produced the way a user produces one: the real builder prepares the first records of
the shipped Turkish sample, ``init_tiny_base`` writes a random dense (Llama-shaped) base, and
``nedolm-sft run`` trains it for a few steps in a real subprocess.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path

import pytest
import yaml

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.train.testing import init_tiny_base

DEFAULT = files("nedolm_sft") / "default"
BENCH = Path(__file__).resolve().parents[1] / "bench"
SEQ_LEN = 128
DENSE_TINY = {
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_dim": 160,
    "n_morph_classes": 0,
    "morph_expert_dim": 0,
    "max_seq_len": 256,
}


def write_sft_config(path: Path, data_dir: Path, **base: str) -> Path:
    """A 3-step CPU SFT YAML at ``path`` (run dir beside it) starting from ``base``."""
    config = {
        "run_dir": str(path.parent / "run"),
        "data_dir": str(data_dir),
        **base,
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "train": {
            "seq_len": SEQ_LEN,
            "micro_batch_size": 2,
            "grad_accum_steps": 1,
            "max_steps": 3,
            "num_workers": 0,
            "compile": False,
            "log_interval": 1,
        },
        "validation": {"shard_ids": [3], "interval": 3, "batches": 1},
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="session")
def sft_config() -> Callable[..., Path]:
    """``sft_config(path, data_dir, **base_keys)``: write a short SFT YAML (see write_sft_config)."""
    return write_sft_config


@pytest.fixture(scope="session")
def sample_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sample")
    lines = Path(str(DEFAULT / "tr_chat_sample.jsonl")).read_text(encoding="utf-8").splitlines()
    sample = root / "sample.jsonl"
    sample.write_text("\n".join(lines[:160]) + "\n", encoding="utf-8")
    build_corpus(
        [sample],
        Path(str(DEFAULT / "tokenizer.json.gz")),
        root / "data",
        BuildOptions(seq_len=SEQ_LEN, shards=4, val_shards=(3,)),
    )
    return root / "data"


@pytest.fixture(scope="session")
def dense_run(sample_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory holding a dense model trained for 3 steps by ``nedolm-sft run``."""
    root = tmp_path_factory.mktemp("dense")
    init_tiny_base(root / "base", sample_corpus, DENSE_TINY)
    write_sft_config(
        root / "sft.yaml",
        sample_corpus,
        base_config=str(root / "base" / "config.yaml"),
        base_run_dir=str(root / "base"),
    )
    subprocess.run(
        [sys.executable, "-m", "nedolm_sft", "run", str(root / "sft.yaml")],
        check=True,
        timeout=300,
        capture_output=True,
    )
    return root / "run"


@pytest.fixture
def trainer_gpu(monkeypatch: pytest.MonkeyPatch):
    """``bench/trainer_gpu.py`` imported as a module (bench/ on the path: it imports its
    neighbours, compile_trace and model_gpu)."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("trainer_gpu", BENCH / "trainer_gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "trainer_gpu", module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module
