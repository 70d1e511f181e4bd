"""``read_metrics``: the one reader of ``metrics.jsonl`` (trainer tests, plot, demo)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from nedolm.train.metrics import (
    MetricsError,
    MetricsWriter,
    SinkUnavailable,
    read_metrics,
    split_metrics,
)


def test_reads_what_the_writer_wrote_and_splits_validation(tmp_path: Path) -> None:
    assert read_metrics(tmp_path) == []
    writer = MetricsWriter(tmp_path)
    records = [
        {"step": 0, "kind": "validation", "val_loss": 3.5},
        {"step": 1, "loss": 3.25, "lr": 1e-3},
        {"step": 1, "kind": "validation", "val_loss": 3.0},
    ]
    for record in records:
        writer.write(record)
    writer.close()
    with (tmp_path / "metrics.jsonl").open("a", encoding="utf-8") as handle:
        handle.write('{"step": 2, "lo')  # a record cut by a kill -9: not complete, left out
    assert read_metrics(tmp_path) == records
    train, validation = split_metrics(read_metrics(tmp_path))
    assert train == [records[1]] and validation == [records[0], records[2]]


def test_a_bad_complete_line_is_named(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n\n{not json\n')
    with pytest.raises(MetricsError, match=r"metrics\.jsonl:3: not a JSON line"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("[1, 2]\n")
    with pytest.raises(MetricsError, match=r"metrics\.jsonl:1: not a JSON object"):
        read_metrics(tmp_path)


def test_a_re_trained_step_keeps_its_last_record_in_step_order(tmp_path: Path) -> None:
    """After resumes, steps 3-4 are logged three times: the last of each is the curve's."""
    first = [{"step": 0, "kind": "validation", "val_loss": 4.0}]
    first += [{"step": s, "loss": 10.0 - s} for s in (1, 2, 3, 4)]
    again = [{"step": s, "loss": 20.0 - s} for s in (3, 4)]
    last = [{"step": s, "loss": 30.0 - s} for s in (3, 4, 5)]
    last.append({"step": 5, "kind": "validation", "val_loss": 3.0})
    train, validation = split_metrics(first + again + last)
    assert [(r["step"], r["loss"]) for r in train] == [
        (1, 9.0),
        (2, 8.0),
        (3, 27.0),
        (4, 26.0),
        (5, 25.0),
    ]
    assert [r["step"] for r in validation] == [0, 5]


def test_tensorboard_sink_holds_the_records_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path, ["tensorboard"])
    writer.write({"step": 1, "loss": 3.25, "lr": 1e-3})
    writer.write({"step": 2, "loss": 3.0, "lr": 2e-3})
    writer.write({"step": 2, "kind": "validation", "val_loss": 2.5})
    writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 3.25), (2, 3.0)]
    assert [(e.step, e.value) for e in events.Scalars("validation/val_loss")] == [(2, 2.5)]


def test_wandb_sink_logs_offline_into_one_run_per_run_dir(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for step in (1, 2):  # two jobs of the same run dir (a resume)
        writer = MetricsWriter(tmp_path, ["wandb"])
        writer.write({"step": step, "loss": 4.0 - step})
        writer.close()
    run_id = (tmp_path / "wandb_run_id").read_text(encoding="utf-8").strip()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # offline-run-TIMESTAMP-ID, with "-N" appended when both jobs start within one second
    same_run = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    assert len(runs) == 2 and all(same_run.fullmatch(r.name) for r in runs), runs
    assert all((r / f"run-{run_id}.wandb").stat().st_size > 0 for r in runs)


@pytest.mark.parametrize("sink", ["tensorboard", "wandb"])
def test_a_missing_sink_names_its_extra(tmp_path: Path, monkeypatch, sink: str) -> None:
    module = "torch.utils.tensorboard" if sink == "tensorboard" else "wandb"
    monkeypatch.setitem(sys.modules, module, None)  # how Python marks a module not importable
    with pytest.raises(SinkUnavailable, match=rf"pip install 'nedolm-train\[{sink}\]'"):
        MetricsWriter(tmp_path, [sink])
    assert not (tmp_path / "metrics.jsonl").exists()
