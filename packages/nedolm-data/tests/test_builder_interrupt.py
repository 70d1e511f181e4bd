"""A build killed with SIGKILL leaves nothing that looks like a corpus; the next build recovers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.contract import DatasetContractError, validate_dataset_contract
from nedolm.data.verify import check_corpus


def _big_input(path, sources, copies):
    """The fixture records repeated with fresh ids: a build that takes a few seconds."""
    with path.open("w", encoding="utf-8") as out:
        for copy in range(copies):
            for source in sources:
                for n, line in enumerate(source.read_text(encoding="utf-8").splitlines()):
                    record = json.loads(line)
                    record["id"] = f"{source.stem}-{n}-{copy}"
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


@pytest.mark.slow
def test_sigkill_mid_build_leaves_no_valid_looking_directory(
    tmp_path, tr_chat_inputs, sentencepiece_model
):
    inputs = _big_input(tmp_path / "big.jsonl", tr_chat_inputs, copies=40)
    out = tmp_path / "corpus"
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from nedolm.data.builder import BuildOptions, build_corpus
        build_corpus([Path({str(inputs)!r})], Path({str(sentencepiece_model)!r}), Path({str(out)!r}),
                     BuildOptions(seq_len=1024, shards=4, chunk_records=32))
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        # wait until shard data is being written, then kill without warning
        while time.monotonic() < deadline:
            parts = list(tmp_path.glob(".corpus.tmp-*/shards/.part-*.tokens.bin.tmp-*"))
            if parts and parts[0].stat().st_size > 4096:
                break
            assert child.poll() is None, "the build finished before it could be interrupted"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL

    assert not out.exists()
    (leftover,) = tmp_path.glob(".corpus.tmp-*")  # hidden, named as temporary, no contract files
    assert not (leftover / "SHARD_MANIFEST.json").exists()
    assert not (leftover / "FINAL_BINARY_VERIFY_REPORT.json").exists()
    with pytest.raises(DatasetContractError, match="contract missing"):
        validate_dataset_contract(leftover, 32003, 1024)

    report = build_corpus(tr_chat_inputs, sentencepiece_model, out, BuildOptions(seq_len=1024))
    assert report.documents > 0
    assert check_corpus(out) == []
    assert not list(tmp_path.glob(".corpus.tmp-*"))  # the dead build's leftovers are cleaned up
