"""The embedded default runs end to end: corpus, shipped base, SFT, plot, base vs fine-tuned."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml
from matplotlib import image

from nedolm.data.format import Shard
from nedolm.data.sources import doc_key
from nedolm_sft.commands.demo import DEFAULT_DIR, HELDOUT_PROMPTS, SAMPLE, SHARDS, VALIDATION_SHARD

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
    result = nedolm_sft("demo", "--out", str(out), "--steps", "20", "--prompts", "3", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{out}/base/model.safetensors" in (out / "run" / "train.log").read_text()

    records = [
        json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    validation = [r["val_loss"] for r in records if r.get("kind") == "validation"]
    # A curve, not two points: at the start, every 20 // 6 = 3 steps and at the last step.
    assert [r["step"] for r in records if r.get("kind") == "validation"] == [
        0, 3, 6, 9, 12, 15, 18, 20
    ]  # fmt: skip
    assert validation[-1] < validation[0]
    assert sorted((out / "run" / "checkpoints").glob("step-*.pt"))

    png = image.imread(out / "run" / "curves.png")
    assert png.shape[0] > 300 and png.shape[1] > 900
    for name, colour in CURVE_COLOURS.items():
        assert pixels_of(png, colour) > 50, f"no {name} curve drawn"

    comparison = json.loads((out / "comparison.json").read_text(encoding="utf-8"))
    shipped = [json.loads(line) for line in (DEFAULT_DIR / HELDOUT_PROMPTS).open()]
    replies = comparison["replies"]
    # One prompt of each source in turn (the shipped file holds them in blocks by source).
    firsts = {p["source"]: p for p in reversed(shipped)}
    assert [r["prompt"] for r in replies] == [p["prompt"] for p in list(firsts.values())[::-1][:3]]
    assert len({r["source"] for r in replies}) == 3
    for reply in replies:  # side by side: the prompt, then the base's and the fine-tuned reply
        base, tuned = (" ".join(reply[m]["text"].split())[:60] for m in ("base", "fine_tuned"))
        prompt = " ".join(reply["prompt"].split())[:60]
        head = f"[{reply['source']}]\nkullanici>  {prompt}"
        assert head in result.stdout
        after = result.stdout.split(head, 1)[1]
        assert f"base>       {base}" in after
        assert f"fine-tuned> {tuned}" in after.split(f"base>       {base}", 1)[1]
    assert any(r["base"]["text"].strip() for r in replies), result.stdout
    figures = comparison["figures"]
    assert figures["heldout_assistant_loss"] == {
        "base": validation[0],
        "fine_tuned": validation[-1],
    }
    closed = figures["closed_replies"]
    assert closed["base"] == sum(r["base"]["closed"] for r in replies)
    assert closed["fine_tuned"] == sum(r["fine_tuned"]["closed"] for r in replies)
    assert f"base {validation[0]:.3f} → fine-tuned {validation[-1]:.3f}" in result.stdout
    assert f"base {closed['base']}/3 → fine-tuned {closed['fine_tuned']}/3" in result.stdout
    assert "measures the chat format" in result.stdout and "tokens seen" in result.stdout
    assert "nedolm-sft export" in result.stdout

    # OUT/base works on its own: it holds the tokenizer its config names, relative to it.
    base = out / "base"
    assert yaml.safe_load((base / "config.yaml").read_text())["tokenizer"] == "tokenizer.json.gz"
    reply = nedolm_sft("generate", str(base), "--prompt", "Merhaba!", "--max-new-tokens", "8")
    assert reply.returncode == 0 and reply.stdout.strip(), reply.stderr[-3000:]
    exported = nedolm_sft("export", str(base), "--out", str(tmp_path / "base-export"))
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (tmp_path / "base-export" / "tokenizer.json").is_file()

    # The generated config names nothing outside OUT: moved elsewhere, it runs from any
    # directory (here it extends the finished run by 2 steps).
    assert str(tmp_path) not in (out / "sft.yaml").read_text(encoding="utf-8")
    moved = tmp_path / "elsewhere" / "demo"
    moved.parent.mkdir()
    out.rename(moved)
    result = nedolm_sft(
        "run", str(moved / "sft.yaml"), "--set", "train.max_steps=22", cwd=tmp_path / "elsewhere"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "extending the finished run: steps 20 -> 22" in result.stderr
    assert sorted(p.name for p in (moved / "run" / "checkpoints").glob("step-*.pt"))[-1] == (
        "step-00000022.pt"
    )


def test_heldout_prompts_come_from_the_validation_shard(nedolm_sft: RunCli, tmp_path: Path) -> None:
    """The 20 prompts are single-turn conversations that SFT validates on and never trains on."""
    data = tmp_path / "data"
    result = nedolm_sft(
        "prepare",
        str(DEFAULT_DIR / SAMPLE),
        "--tokenizer",
        str(DEFAULT_DIR / "tokenizer.json.gz"),
        "--out",
        str(data),
        "--seq-len",
        "512",
        "--shards",
        str(SHARDS),
        "--val-shards",
        str(VALIDATION_SHARD),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    validation = {
        int(k) for k in Shard.in_dir(data / "shards", VALIDATION_SHARD, SHARDS).index["doc_key"]
    }
    sample = {r["id"]: r for r in map(json.loads, (DEFAULT_DIR / SAMPLE).open())}
    prompts = [json.loads(line) for line in (DEFAULT_DIR / HELDOUT_PROMPTS).open()]
    assert len(prompts) == len({p["id"] for p in prompts}) == 20
    for prompt in prompts:
        record = sample[prompt["id"]]
        assert doc_key(SAMPLE, prompt["id"]) in validation, prompt["id"]
        assert [m["role"] for m in record["messages"]] == ["user", "assistant"]
        assert record["messages"][0]["content"] == prompt["prompt"]
