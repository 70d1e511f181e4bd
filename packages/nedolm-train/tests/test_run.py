"""A whole run in this process: what lands in the run dir, cadences, max_hours, archives,
rotation when a run dir is reused."""

from __future__ import annotations

import json
import threading
import time

import pytest

from nedolm.dist import RankError
from nedolm.train import checksum
from nedolm.train.checkpoint import list_checkpoints, load_checkpoint
from nedolm.train.config import load_sft_config
from nedolm.train.metrics import read_metrics, split_metrics
from nedolm.train.optim import lr_at_step
from nedolm.train.stop_record import LAUNCH_ID_ENV, CleanStop, verify_stop
from nedolm.train.trainer import run

real_sha256 = checksum.file_sha256


def test_run_dir_contents_and_cadences(make_config, monkeypatch) -> None:
    monkeypatch.setenv(LAUNCH_ID_ENV, "first")
    config = make_config(
        train={"max_steps": 6, "log_interval": 2, "ckpt_interval": 2, "keep_last": 2},
        validation={"interval": 4},
    )
    run(load_sft_config(config), compile=False)
    run_dir = config.with_suffix("")
    records = read_metrics(run_dir)
    train = [r for r in records if "loss" in r]  # not validation nor checkpoint records
    val = [r for r in records if r.get("kind") == "validation"]
    assert [r["step"] for r in train] == [1, 2, 4, 6]  # first step, every 2, the last
    for record in train:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= record.keys()
        assert record["loss"] > 0 and record["tokens_per_s"] > 0
    assert [r["step"] for r in val] == [0, 4, 6]  # at start, every 4, at the end
    assert all(r["val_loss"] > 0 and r["val_assistant_tokens"] > 0 for r in val)
    assert [s for s, _ in list_checkpoints(run_dir)] == [4, 6]
    state = load_checkpoint(run_dir / "checkpoints" / "step-00000006.pt")
    assert state["progress"]["step"] == 6 and set(state["contract"]) == {
        "dataset",
        "training",
        "execution",
    }
    meta = json.loads((run_dir / "run_metadata.json").read_text(encoding="utf-8"))
    assert [s["start_step"] for s in meta["starts"]] == [0]
    resolved = json.loads((run_dir / "config.resolved.json").read_text(encoding="utf-8"))
    assert resolved["max_steps"] == 6 and resolved["corpus_stats"]["windows"] == 38
    log = (run_dir / "train.log").read_text(encoding="utf-8")
    assert "step 6/6 epoch 0.32 loss" in log and "eta 0:00:00" in log
    # The end of training is a clean stop too, for a signal that reaches the launcher late.
    assert verify_stop(run_dir, "first") == CleanStop(step=6, trained=True)

    # Reusing the run dir: a finished run resumes, trains nothing and keeps its checkpoints.
    # The checkpoint it resumes from is hashed (read in full) once, not once more to load it.
    hashed = []
    monkeypatch.setattr(
        checksum, "file_sha256", lambda path: hashed.append(path.name) or real_sha256(path)
    )
    run(load_sft_config(config), compile=False)
    assert hashed == ["step-00000006.pt"]
    assert [s for s, _ in list_checkpoints(run_dir)] == [4, 6]
    meta = json.loads((run_dir / "run_metadata.json").read_text(encoding="utf-8"))
    assert [s["start_step"] for s in meta["starts"]] == [0, 6]


def test_max_hours_checkpoints_and_returns(make_config) -> None:
    config = make_config(train={"max_hours": 1e-9, "control_interval": 3})
    run(load_sft_config(config), compile=False)
    run_dir = config.with_suffix("")
    # Over time at step 1's fetch: the limit rides that step's all-reduce, not a control point.
    assert [s for s, _ in list_checkpoints(run_dir)] == [1]
    assert "stop requested (max_hours)" in (run_dir / "train.log").read_text(encoding="utf-8")


def test_archives_on_a_wall_clock_cadence(make_config) -> None:
    config = make_config(
        train={"max_steps": 3, "archive_interval_hours": 1e-9, "control_interval": 2}
    )
    run(load_sft_config(config), compile=False)
    archives = sorted((config.with_suffix("") / "archives").iterdir())
    assert [p.name for p in archives] == ["model-00000002.pt", "model-00000003.pt"]
    archive = load_checkpoint(archives[-1])
    assert set(archive) >= {"model", "model_config", "eos_id", "fingerprints"}
    assert "optimizer" not in archive


def test_held_out_shard_is_not_trained_when_validation_is_off(make_config) -> None:
    """Issue 15 bug 2: the corpus holds shard 2 out (VAL_SHARD); disabling validation must not
    train it, unless validation.train_on_held_out says so; the log names the split."""
    config = make_config("off", train={"max_steps": 1}, validation={"enabled": False})
    run(load_sft_config(config), compile=False)
    log = (config.with_suffix("") / "train.log").read_text(encoding="utf-8")
    assert "shards: train [0, 1, 3], validate [], held out by the corpus [2]" in log
    allowed = make_config(
        "allowed",
        train={"max_steps": 1},
        validation={"enabled": False, "train_on_held_out": True},
    )
    run(load_sft_config(allowed), compile=False)
    log = (allowed.with_suffix("") / "train.log").read_text(encoding="utf-8")
    assert "shards: train [0, 1, 2, 3], validate []" in log


def test_validation_defaults_to_the_corpus_held_out_shards(make_config) -> None:
    config = make_config(train={"max_steps": 2}, validation={"shard_ids": None, "interval": 2})
    run(load_sft_config(config), compile=False)
    log = (config.with_suffix("") / "train.log").read_text(encoding="utf-8")
    assert "shards: train [0, 1, 3], validate [2], held out by the corpus [2]" in log
    val = [r for r in read_metrics(config.with_suffix("")) if r.get("kind") == "validation"]
    assert [r["step"] for r in val] == [0, 2] and all(r["val_loss"] > 0 for r in val)


def test_a_resumed_run_has_one_curve_point_per_step_and_no_second_start_validation(
    make_config,
) -> None:
    config = make_config(train={"max_steps": 4, "ckpt_interval": 2}, validation={"interval": 100})
    run(load_sft_config(config), compile=False)
    run_dir = config.with_suffix("")
    # The job died after step 4 before its checkpoint landed: the resume re-trains 3 and 4.
    for path in (run_dir / "checkpoints").glob("step-00000004.*"):
        path.unlink()
    run(load_sft_config(config), compile=False)
    records = read_metrics(run_dir)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 3, 4]
    train, validation = split_metrics(records)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["step"] for r in validation] == [0, 4]  # at start once, at the end (twice, kept once)
    assert sum(1 for r in records if r.get("kind") == "validation" and r["step"] == 2) == 0


def test_a_finished_run_extends_as_a_new_stage_at_its_final_lr(make_config) -> None:
    config = make_config(
        train={"max_steps": 4, "ckpt_interval": 1, "keep_last": 10},
        optim={"lr": 3e-3, "warmup_steps": 1, "schedule": "cosine", "min_lr_ratio": 0.1},
    )
    run_dir = config.with_suffix("")
    cfg = load_sft_config(config)
    run(cfg, compile=False)
    final_lr = lr_at_step(3, cfg.optim, 4)
    assert final_lr == pytest.approx(3e-4)

    # Everything but a larger max_steps still refuses, naming what changed.
    with pytest.raises(RankError, match=r"ResumeRefused: .* training\.recipe\.optim\.lr:"):
        run(load_sft_config(config, ["train.max_steps=6", "optim.lr=1e-3"]), compile=False)
    with pytest.raises(
        RankError, match=r"ResumeRefused: .*recipe\.max_steps: checkpoint 4 != now 3"
    ):
        run(load_sft_config(config, ["train.max_steps=3"]), compile=False)

    run(load_sft_config(config, ["train.max_steps=6"]), compile=False)
    train, _ = split_metrics(read_metrics(run_dir))
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in train[4:]] == [final_lr, final_lr]
    meta = json.loads((run_dir / "run_metadata.json").read_text(encoding="utf-8"))
    stages = [(s["start_step"], s["max_steps"], s["schedule_steps"]) for s in meta["starts"][-2:]]
    assert stages == [(0, 4, 4), (4, 6, 4)]
    assert "extending the finished run: steps 4 -> 6" in (run_dir / "train.log").read_text()

    # A job killed inside the new stage resumes in it; a second extension keeps the span.
    for path in (run_dir / "checkpoints").glob("step-00000006.*"):
        path.unlink()
    run(load_sft_config(config, ["train.max_steps=6"]), compile=False)
    run(load_sft_config(config, ["train.max_steps=8"]), compile=False)
    state = load_checkpoint(run_dir / "checkpoints" / "step-00000008.pt")
    assert state["progress"]["schedule_steps"] == 4
    train, _ = split_metrics(read_metrics(run_dir))
    assert [r["lr"] for r in train[4:]] == [final_lr] * 4


def test_num_epochs_sets_the_steps_and_the_log_shows_the_epoch(make_config) -> None:
    config = make_config(
        train={"max_steps": 0, "num_epochs": 2, "micro_batch_size": 2, "log_interval": 5},
        validation={"enabled": False},
    )
    run(load_sft_config(config), compile=False)
    run_dir = config.with_suffix("")
    log = (run_dir / "train.log").read_text(encoding="utf-8")
    # 38 training windows, 4 per step: 9.5 steps an epoch, two epochs in 19 steps.
    assert (
        "schedule: 19 steps = 2.00 epochs; global batch 4 windows (micro 2 x accum 2 x 1 ranks), "
        "9.50 steps per epoch" in log
    )
    assert "step 10/19 epoch 1.05 loss" in log and "step 19/19 epoch 2.00 loss" in log
    train, _ = split_metrics(read_metrics(run_dir))
    assert train[-1]["epoch"] == 2.0


def test_report_to_mirrors_the_run_to_tensorboard_and_cpu_reports_no_mfu(make_config) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = make_config(train={"max_steps": 2, "report_to": ["tensorboard"]})
    run(load_sft_config(config), compile=False)
    run_dir = config.with_suffix("")
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    train, _ = split_metrics(read_metrics(run_dir))
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (r["step"], pytest.approx(r["loss"])) for r in train
    ]
    assert "mfu" not in train[-1]  # MFU is a CUDA figure (against the device's bf16 peak)


def test_a_run_returns_only_once_its_staging_buffers_are_reserved(make_config, monkeypatch):
    """Rank 0 reserves async-checkpoint buffers in the background from before the warm-up; a
    run shorter than that reservation waits for it before anything is torn down (a pinned
    allocation racing the process group's teardown, or the interpreter's, is not safe)."""
    monkeypatch.setenv("NEDOLM_TEST_DELAY", "staging_reserve=3")
    train = {"max_steps": 1, "async_checkpoint": True, "save_final_checkpoint": False}
    config = make_config(train=train)  # no checkpoint: nothing else waits for the buffers
    started = time.monotonic()
    run(load_sft_config(config), compile=False)
    assert time.monotonic() - started >= 3
    assert not [t for t in threading.enumerate() if t.name == "staging-buffers"]
