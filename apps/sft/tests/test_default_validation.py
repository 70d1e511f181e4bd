"""The newcomer path: ``prepare`` with no split options, then ``run`` with no validation keys,
validates on the shard the corpus holds out and never trains on it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from nedolm.train.metrics import read_metrics, split_metrics
from nedolm.train.testing import CLI_ENV, SMALL_BASE, init_tiny_base, write_sft_config

FIXTURES = Path(__file__).resolve().parents[3] / "packages" / "nedolm-data" / "tests" / "fixtures"
RunCli = Callable[..., subprocess.CompletedProcess[str]]  # the conftest's nedolm_sft fixture


def test_default_prepare_then_run_validates_on_the_held_out_shard(
    nedolm_sft: RunCli, tmp_path: Path
) -> None:
    data = tmp_path / "corpus"
    inputs = [str(p) for p in sorted((FIXTURES / "tr_chat").glob("*.jsonl"))]
    tokenizer = FIXTURES / "tokenizer" / "mistral_v1.tokenizer.json.gz"
    prepared = nedolm_sft(
        "prepare", *inputs, "--tokenizer", str(tokenizer), "--out", str(data),
        "--seq-len", "256", "--no-progress", env=CLI_ENV,
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr
    assert "20 shards, validation [19]," in prepared.stdout
    manifest = json.loads((data / "SHARD_MANIFEST.json").read_text(encoding="utf-8"))
    assert manifest["validation_shard_ids"] == [19]

    base = init_tiny_base(tmp_path / "base", data, {**SMALL_BASE, "max_seq_len": 256})
    optim = {"lr": 1e-3, "warmup_steps": 1}
    train = {"seq_len": 256, "max_steps": 2, "num_workers": 0}
    config = write_sft_config(tmp_path / "run.yaml", data, base, optim=optim, train=train)
    result = nedolm_sft("run", str(config), "--no-compile", env=CLI_ENV)
    assert result.returncode == 0, result.stderr
    train_ids = ", ".join(str(i) for i in range(19))
    assert f"shards: train [{train_ids}], validate [19], held out by the corpus [19]" in (
        result.stderr
    )
    _, validation = split_metrics(read_metrics(tmp_path / "run"))
    assert validation and all(r["val_loss"] > 0 for r in validation)
