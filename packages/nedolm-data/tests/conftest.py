"""Shared fixtures: the committed real-data subset, its tokenizers, and one corpus built from it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from nedolm.data.builder import BuildOptions, build_corpus

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def tokenizer_json() -> Path:
    """mistral_v1 ``tokenizer.json`` (gzipped): lossless, so decoding gives the source text."""
    return FIXTURES / "tokenizer" / "mistral_v1.tokenizer.json.gz"


@pytest.fixture(scope="session")
def tanai(fixtures_dir: Path) -> Path:
    """The tanai tokenizer.json: encodes a zero-width space to nothing and reads "<s>" as BOS."""
    return fixtures_dir / "tokenizer" / "tanai.tokenizer.json.gz"


@pytest.fixture(scope="session")
def sentencepiece_model() -> Path:
    """The same mistral_v1 tokenizer as a SentencePiece model (gzipped; loads 10x faster)."""
    return FIXTURES / "tokenizer" / "mistral_v1.model.gz"


@pytest.fixture(scope="session")
def tr_chat_inputs() -> list[Path]:
    return sorted((FIXTURES / "tr_chat").glob("*.jsonl"))


@pytest.fixture(scope="session")
def fixture_corpus(tmp_path_factory, tr_chat_inputs, tokenizer_json) -> Path:
    """The Turkish fixture built at seq_len 1024 into 2 shards, shard 1 held out. Read-only."""
    out = tmp_path_factory.mktemp("corpus") / "data"
    build_corpus(
        tr_chat_inputs, tokenizer_json, out, BuildOptions(seq_len=1024, shards=2, val_shards=(1,))
    )
    return out


@pytest.fixture
def corpus(fixture_corpus: Path, tmp_path: Path) -> Path:
    """A private copy of ``fixture_corpus`` to edit or damage."""
    return Path(shutil.copytree(fixture_corpus, tmp_path / "data"))
