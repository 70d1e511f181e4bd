"""``prepare --mix … --val-input`` then ``run``: validation reads the separate files, metrics.jsonl
logs each file's loss beside the overall one, and ``plot`` draws a curve per file. Real
processes on the committed real-data fixture; the plot is titled by the run's name only."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from matplotlib.text import Text

from nedolm.data.packing import discover_sft_shards
from nedolm.train.metrics import MetricsWriter, read_metrics, split_metrics
from nedolm.train.testing import CLI_ENV, SMALL_BASE, init_tiny_base, write_sft_config
from nedolm_sft.commands.plot import draw_curves

FIXTURES = Path(__file__).resolve().parents[3] / "packages" / "nedolm-data" / "tests" / "fixtures"
RunCli = Callable[..., subprocess.CompletedProcess[str]]  # the conftest's nedolm_sft fixture
VAL_FILES = ("tquad_enelpi_train.jsonl", "seed_tasks_tr.jsonl")


def test_val_inputs_validate_per_source_through_a_training_run(
    nedolm_sft: RunCli, tmp_path: Path
) -> None:
    chat, data = FIXTURES / "tr_chat", tmp_path / "corpus"
    prepared = nedolm_sft(
        "prepare", "--mix", f"{chat / 'nutuk_qa.jsonl'}=0.6", "--mix", f"{chat / 'truthfulqa_tr.jsonl'}=0.4",
        "--val-input", str(chat / VAL_FILES[0]), "--val-input", str(chat / VAL_FILES[1]),
        "--tokenizer", str(FIXTURES / "tokenizer" / "mistral_v1.tokenizer.json.gz"),
        "--out", str(data), "--seq-len", "256", "--shards", "2", "--no-progress", env=CLI_ENV,
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr
    assert "4 shards, validation [2, 3]," in prepared.stdout
    assert f"validation {VAL_FILES[0]}: shard 2, 4 conversations" in prepared.stdout
    # training trains on a mixture too: 0.6 of 16 is 9.6, so 10 nutuk and 6 truthfulqa
    assert "mixture nutuk_qa.jsonl (weight 0.6): 10 conversations" in prepared.stdout
    stats = nedolm_sft("stats", str(data), env=CLI_ENV)
    assert f"validation {VAL_FILES[1]}: shard 3, 8 conversations" in stats.stdout
    val_shards = [s for s in discover_sft_shards(data, 256) if s.shard_id in (2, 3)]
    windows = sum(s.plan.counts.windows for s in val_shards)

    base = init_tiny_base(tmp_path / "base", data, {**SMALL_BASE, "max_seq_len": 256})
    config = write_sft_config(
        tmp_path / "run.yaml",
        data,
        base,
        optim={"lr": 1e-3, "warmup_steps": 1},
        train={"seq_len": 256, "max_steps": 2, "num_workers": 0, "micro_batch_size": 1},
        # every validation window exactly once per pass
        validation={"interval": 1, "batches": windows, "micro_batch_size": 1},
    )
    result = nedolm_sft("run", str(config), "--no-compile", env=CLI_ENV)
    assert result.returncode == 0, result.stderr
    assert "shards: train [0, 1], validate [2, 3]" in result.stderr

    _, validation = split_metrics(read_metrics(tmp_path / "run"))
    assert [r["step"] for r in validation] == [0, 1, 2]
    targets = {
        name: s.plan.counts.assistant_target_tokens
        for name, s in zip(VAL_FILES, sorted(val_shards, key=lambda s: s.shard_id), strict=True)
    }
    for record in validation:
        losses = record["val_loss_by_source"]
        assert set(losses) == set(VAL_FILES)
        assert record["val_assistant_tokens_by_source"] == targets
        assert record["val_assistant_tokens"] == sum(targets.values())
        weighted = sum(losses[n] * targets[n] for n in VAL_FILES) / sum(targets.values())
        assert abs(record["val_loss"] - weighted) <= 1e-9 * weighted

    plotted = nedolm_sft("plot", str(tmp_path / "run"), env=CLI_ENV)
    assert plotted.returncode == 0, plotted.stderr
    labels = draw_curves(tmp_path / "run").axes[0].get_legend_handles_labels()[1]
    assert [f"validation: {name}" for name in sorted(VAL_FILES)] == [
        label for label in labels if label.startswith("validation: ")
    ]


def test_plot_title_names_the_run_not_its_absolute_path(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "sft-demo"
    run_dir.mkdir(parents=True)
    writer = MetricsWriter(run_dir)
    for step in (1, 2):
        writer.write({"step": step, "kind": "train", "loss": 3.0 / step, "lr": 1e-3})
    writer.write({"step": 2, "kind": "validation", "val_loss": 2.5})
    writer.close()
    figure = draw_curves(run_dir.resolve())
    texts = [t.get_text() for t in figure.findobj(Text)]
    assert figure.get_suptitle() == "NedoLM SFT — sft-demo"
    assert not [t for t in texts if str(run_dir.parent) in t or "runs/" in t]
