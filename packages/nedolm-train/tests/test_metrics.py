"""``read_metrics``: the one reader of ``metrics.jsonl`` (trainer tests, plot, demo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nedolm.train.metrics import MetricsError, MetricsWriter, read_metrics, split_metrics


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
