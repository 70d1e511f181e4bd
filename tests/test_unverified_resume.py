"""``nedolm-sft run`` and a checkpoint that carries no digest (written before digests existed,
its sidecar lost): refused by default, naming the file and the way out; resumed from with
``--trust-unverified``, which says so in the log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
import yaml


def _run(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nedolm_sft", "run", str(config), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_checkpoint_without_any_digest_is_resumed_only_with_trust_unverified(
    dense_run: Path, tmp_path: Path
) -> None:
    config = yaml.safe_load((dense_run.parent / "sft.yaml").read_text(encoding="utf-8"))
    config["run_dir"] = str(tmp_path / "run")
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    bare = tmp_path / "run" / "checkpoints" / "step-00000003.pt"
    bare.parent.mkdir(parents=True)
    state = torch.load(dense_run / "checkpoints" / bare.name, weights_only=True)
    torch.save(state, bare)  # as the versions before the digests wrote it, no sidecar

    refused = _run(path)
    assert refused.returncode != 0
    assert (
        f"no valid checkpoint in {bare.parent}: {bare} carries no digest (no "
        "step-00000003.pt.sha256 beside it and none inside it), so it cannot be verified; "
        "restart with --trust-unverified to resume from it anyway"
    ) in refused.stderr + refused.stdout

    trusted = _run(path, "--trust-unverified")
    assert trusted.returncode == 0, trusted.stderr[-3000:]
    log = (tmp_path / "run" / "train.log").read_text(encoding="utf-8")
    assert f"resuming from {bare} unverified: it carries no digest (--trust-unverified)" in log
    assert f"resuming from {bare} at step 3" in log
