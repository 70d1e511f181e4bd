"""Fixtures shared by the app's tests."""

from __future__ import annotations

import gzip
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from nedolm.data.builder import BuildOptions, build_corpus

FIXTURES = Path(__file__).resolve().parents[3] / "packages" / "nedolm-data" / "tests" / "fixtures"
RunCli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def nedolm_sft() -> RunCli:
    """Run ``nedolm-sft ARGS…`` as a real process (``python -m nedolm_sft``), output captured."""

    def run(
        *args: str,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "nedolm_sft", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            env=env,
        )

    return run


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real corpus at seq_len 256 (2 shards, none held out) from the data package's Turkish
    chat fixtures."""
    root = tmp_path_factory.mktemp("corpus")
    tokenizer = root / "tokenizer.json"
    tokenizer.write_bytes(
        gzip.decompress((FIXTURES / "tokenizer" / "mistral_v1.tokenizer.json.gz").read_bytes())
    )
    inputs = sorted((FIXTURES / "tr_chat").glob("[nt]*.jsonl"))  # nutuk, tquad, truthfulqa
    options = BuildOptions(seq_len=256, shards=2, val_fraction=0)  # what tests train on: all
    build_corpus(inputs, tokenizer, root / "data", options)
    return root / "data"
