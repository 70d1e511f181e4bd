"""The embedded default runs end to end: corpus, base, SFT with validation, plot, a reply."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image

RunCli = Callable[..., subprocess.CompletedProcess[str]]  # the conftest's nedolm_sft fixture

# Line colours of the plot's curves (matplotlib's tab10): train, validation, lr, throughput.
CURVE_COLOURS = {
    "train loss": (31, 119, 180),
    "validation loss": (255, 127, 14),
    "learning rate": (44, 160, 44),
    "throughput": (214, 39, 40),
}


def pixels_of(png: np.ndarray, rgb: tuple[int, int, int]) -> int:
    target = np.array(rgb) / 255.0
    return int((np.abs(png[..., :3] - target).max(axis=-1) < 0.02).sum())


@pytest.mark.slow
def test_demo_runs_end_to_end(nedolm_sft: RunCli, tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = nedolm_sft("demo", "--out", str(out), "--steps", "4", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]

    records = [
        json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    validation = [r["val_loss"] for r in records if r.get("kind") == "validation"]
    assert len(validation) >= 2
    assert validation[-1] < validation[0]
    assert sorted((out / "run" / "checkpoints").glob("step-*.pt"))

    png = image.imread(out / "run" / "curves.png")
    assert png.shape[0] > 300 and png.shape[1] > 900
    for name, colour in CURVE_COLOURS.items():
        assert pixels_of(png, colour) > 50, f"no {name} curve drawn"

    reply = result.stdout.split("asistan> ", 1)[1].split("\n", 1)[0]
    assert reply.strip(), result.stdout
    assert "nedolm-sft export" in result.stdout
