"""What export and generate say about the directories they are pointed at, and what a failed
export leaves behind (nothing), on a real full filesystem."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nedolm.train.testing import CLI_ENV, SMALL_BASE, mounted_tmpfs, set_options

RunCli = Callable[..., subprocess.CompletedProcess[str]]  # the conftest's nedolm_sft fixture


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB filesystem (the tests run as root): too small for any export."""
    with mounted_tmpfs(tmp_path / "exports", "1m") as mount_point:
        yield mount_point


def test_a_failed_export_leaves_nothing_behind(
    nedolm_sft: RunCli, corpus: Path, tmp_path: Path, small_tmpfs: Path
) -> None:
    base = tmp_path / "base"
    sets = set_options({**SMALL_BASE, "max_seq_len": 256})
    made = nedolm_sft(
        "init-base", "--preset", "tiny", "--data-dir", str(corpus), "--out", str(base), *sets
    )
    assert made.returncode == 0, made.stderr
    args = ("export", str(base), "--data-dir", str(corpus), "--out", str(small_tmpfs / "hf"))
    result = nedolm_sft(*args, env=CLI_ENV)
    assert result.returncode == 1
    assert "No space left on device" in result.stderr, result.stderr
    assert list(small_tmpfs.iterdir()) == []  # no hf/, no hf.tmp-export/


def test_generate_on_a_corpus_says_it_is_a_corpus(nedolm_sft: RunCli, corpus: Path) -> None:
    result = nedolm_sft("generate", str(corpus), "--prompt", "Merhaba", env=CLI_ENV)
    assert result.returncode == 2
    assert f"{corpus} is a prepared corpus, not a model" in result.stderr
