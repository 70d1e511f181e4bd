"""What a run reports: ``metrics.jsonl``, a readable ``train.log``, a progress line, and the
sinks of ``train.report_to`` (TensorBoard, Weights & Biases), each an optional extra.

``setup_logging`` routes the ``nedolm`` loggers to stderr and ``RUN_DIR/train.log``; INFO comes
from rank 0 only (``MainRankFilter``), warnings from every rank. ``MetricsWriter`` is used on
rank 0 only (the loop calls it through ``main_rank_call``): one JSON object per line, flushed per
line, so a killed job loses nothing already logged. Losses are written at full precision so that
two runs can be compared bitwise. ``metrics.jsonl`` is always written; the sinks mirror it.
"""

from __future__ import annotations

import datetime
import importlib
import json
import logging
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nedolm.dist import MainRankFilter

LOG_FILE = "train.log"
METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"
"""The W&B run id of this run dir, kept so that a resumed job logs into the same W&B run."""
SINK_EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""``train.report_to`` name -> the nedolm-train extra that installs it."""
_FORMAT = "%(asctime)s [rank %(rank)s] %(levelname)s %(message)s"


def setup_logging(run_dir: Path | None) -> None:
    """Log ``nedolm.*`` to stderr, and to ``run_dir/train.log`` when given (rank 0 writes)."""
    logger = logging.getLogger("nedolm")
    logger.setLevel(logging.INFO)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if run_dir is not None:
        handlers.append(logging.FileHandler(run_dir / LOG_FILE, encoding="utf-8"))
    for handler in handlers:
        handler.addFilter(MainRankFilter())
        handler.setFormatter(logging.Formatter(_FORMAT))
        logger.addHandler(handler)
    logger.propagate = False


def format_eta(seconds: float) -> str:
    """``H:MM:SS`` for the progress line."""
    return str(datetime.timedelta(seconds=max(0, round(seconds))))


class SinkUnavailable(RuntimeError):
    """A ``train.report_to`` sink whose package is not installed."""


def require_sinks(names: Sequence[str]) -> None:
    """Refuse, before any work, a sink whose package is missing, naming the extra to install."""
    for name in names:
        module = "torch.utils.tensorboard" if name == "tensorboard" else name
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise SinkUnavailable(
                f"train.report_to names {name}, which is not installed ({exc}): "
                f"pip install 'nedolm-train[{SINK_EXTRAS[name]}]'"
            ) from None


class _TensorBoard:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, prefix: str, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(f"{prefix}/{key}", value, step)

    def close(self) -> None:
        self._writer.close()


class _WandB:
    """One W&B run per run dir (its id kept in the run dir), project from $WANDB_PROJECT."""

    def __init__(self, run_dir: Path) -> None:
        import wandb

        id_file = run_dir / WANDB_ID_FILE
        if not id_file.is_file():
            id_file.write_text(secrets.token_hex(8) + "\n", encoding="utf-8")
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "nedolm-sft"),
            name=run_dir.name,
            id=id_file.read_text(encoding="utf-8").strip(),
            resume="allow",
            dir=str(run_dir),
        )

    def write(self, prefix: str, step: int, scalars: dict[str, float]) -> None:
        self._run.log({f"{prefix}/{key}": value for key, value in scalars.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


_SINKS = {"tensorboard": _TensorBoard, "wandb": _WandB}


class MetricsWriter:
    """Appends metric records to ``metrics.jsonl`` and mirrors their scalars to the sinks."""

    def __init__(self, run_dir: Path, report_to: Sequence[str] = ()) -> None:
        require_sinks(report_to)
        path = run_dir / METRICS_FILE
        _drop_partial_last_line(path)
        self._file = path.open("a", encoding="utf-8")
        self._sinks = [_SINKS[name](run_dir) for name in report_to]

    def write(self, record: dict[str, Any]) -> None:
        """One record; ``step`` is the sinks' x axis, ``kind`` their tag prefix."""
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()
        scalars = {
            key: value
            for key, value in record.items()
            if isinstance(value, (int, float)) and key != "step"
        }
        for sink in self._sinks:
            sink.write(record.get("kind", "train"), record["step"], scalars)

    def close(self) -> None:
        """Flush and close the file and the sinks."""
        self._file.close()
        for sink in self._sinks:
            sink.close()


def _drop_partial_last_line(path: Path) -> None:
    """A job killed mid-write leaves half a line; cut it so the file stays valid JSONL."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as handle:
            handle.truncate(data.rfind(b"\n") + 1)


class MetricsError(ValueError):
    """A complete line of ``metrics.jsonl`` that is not a JSON object."""


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of ``RUN_DIR/metrics.jsonl`` in order; the one reader of that file.

    An unterminated last line is a record being written (or cut by a kill) and is left out;
    any other bad line raises ``MetricsError`` naming the file and line number.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")[:-1]  # the part after the last newline is not complete yet
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise MetricsError(f"{path}:{number}: not a JSON line ({exc.msg})") from exc
        if not isinstance(record, dict):
            raise MetricsError(f"{path}:{number}: not a JSON object")
        records.append(record)
    return records


def split_metrics(
    records: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training step records, validation records) of ``read_metrics``, one per step, by step.

    A resumed run re-trains the steps after its checkpoint and appends their lines again; the
    last record of a step (the one the surviving weights came from) is the one kept, so curves
    never zig-zag back over re-trained steps.
    """
    train: dict[int, dict[str, Any]] = {}
    validation: dict[int, dict[str, Any]] = {}
    for record in records:
        if record.get("kind") == "validation":
            validation[record["step"]] = record
        elif "loss" in record:
            train[record["step"]] = record
    return [train[s] for s in sorted(train)], [validation[s] for s in sorted(validation)]
