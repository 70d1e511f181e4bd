"""``profile.start_step``: a torch.profiler window of real training steps, written per rank
(trace, top ops, per-step summary), whole or not at all, and never the end of the run."""

from __future__ import annotations

import gzip
import json
import random
import signal
import warnings
from pathlib import Path

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from nedolm.train.config import ConfigError, load_sft_config
from nedolm.train.profiling import ProfileSummary, StepProfiler, busy_time, summarize
from nedolm.train.trainer import run, smoke_run_dir

STEPS = 6


def test_busy_time_is_the_length_of_the_union_of_intervals() -> None:
    rng = random.Random(0)
    for _ in range(200):
        intervals = []
        for _ in range(rng.randint(0, 12)):
            start = rng.randint(0, 60)
            intervals.append((start, start + rng.randint(0, 15)))
        covered = {t for start, end in intervals for t in range(start, end)}  # unit cells
        assert busy_time(intervals) == len(covered)


def test_the_device_figures_of_a_summary() -> None:
    """The CUDA branch, on the profiler's own event records as a GPU profile holds them: kernels
    on two streams overlap, the host waits in cudaStreamSynchronize and reads one scalar; a
    record_function region's span on the device (a gpu_user_annotation) is not device work."""

    def event(
        name: str, start: float, end: float, device: DeviceType, annotation: bool = False
    ) -> FunctionEvent:
        return FunctionEvent(
            id=0,
            name=name,
            thread=0,
            start_us=start,
            end_us=end,
            device_type=device,
            is_user_annotation=annotation,
        )

    kernels = [(0, 100), (50, 150), (200, 260), (400, 440)]  # union: 150 + 60 + 40 us
    events = [event(f"kernel{i}", *span, DeviceType.CUDA) for i, span in enumerate(kernels)]
    events += [
        event("Optimizer.step#AdamW.step", 0, 440, DeviceType.CUDA, annotation=True),
        event("cudaStreamSynchronize", 100, 300, DeviceType.CPU),
        event("cudaLaunchKernel", 0, 5, DeviceType.CPU),
        event("aten::_local_scalar_dense", 290, 300, DeviceType.CPU),
    ]
    summary = summarize(events, 3, 4, wall_s=0.002)
    assert summary == ProfileSummary(3, 4, 1.0, 0.5, 0.125, 2.0, 0.1)
    assert summary.describe() == (
        "steps 3-4: 1.0 ms per step, device busy 0.1 ms (12%) in 2 device ops, host waiting on "
        "it 0.1 ms, 0.5 scalar reads (.item())"
    )


def profile_files(run_dir: Path, first: int, last: int, rank: int = 0) -> dict:
    """The window's files of ``rank``: the summary, the ops table and the parsed trace."""
    out = run_dir / "profile" / f"steps-{first}-{last}"
    summary = json.loads((out / f"rank{rank}.summary.json").read_text(encoding="utf-8"))
    trace = json.loads(gzip.decompress((out / f"rank{rank}.trace.json.gz").read_bytes()))
    ops = (out / f"rank{rank}.ops.txt").read_text(encoding="utf-8")
    return {"summary": summary, "trace": trace, "ops": ops, "dir": out}


def test_a_window_of_steps_is_profiled_and_summarised(make_config) -> None:
    train = {"max_steps": STEPS, "log_interval": 2}
    config = make_config(train=train, profile={"start_step": 2, "steps": 3})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(load_sft_config(config), compile=False)
    assert [str(w.message) for w in caught if "profiler" in w.filename] == []
    run_dir = config.with_suffix("")
    files = profile_files(run_dir, 2, 4)
    summary = files["summary"]
    assert (summary["first_step"], summary["last_step"], summary["rank"]) == (2, 4, 0)
    assert summary["wall_ms"] > 0
    # One rank reads the gradient norm every step and the log window's loss at steps 2 and 4
    # (log_interval 2): the loop's documented reads, counted from the trace.
    assert summary["scalar_reads"] == pytest.approx((3 + 2) / 3)
    assert summary["device_busy_ms"] is None  # a CPU: no device ops to time
    names = {event.get("name") for event in files["trace"]["traceEvents"]}
    assert {"aten::mm", "Optimizer.step#AdamW.step"} <= names
    first_line = files["ops"].splitlines()[0]
    assert first_line.startswith("steps 2-4: ") and "Self CPU" in files["ops"]
    assert sorted(p.name for p in files["dir"].iterdir()) == [
        "rank0.ops.txt",
        "rank0.summary.json",
        "rank0.trace.json.gz",
    ]  # no temporaries left
    log = (run_dir / "train.log").read_text(encoding="utf-8")
    assert f"profile (rank 0) of {first_line}; written to {files['dir']}" in log


def test_no_profile_by_default(make_config) -> None:
    config = make_config(train={"max_steps": 2})
    run(load_sft_config(config), compile=False)
    assert not (config.with_suffix("") / "profile").exists()


def test_a_window_past_the_last_step_is_refused_before_training(make_config) -> None:
    config = make_config(train={"max_steps": 3}, profile={"start_step": 4})
    with pytest.raises(ValueError, match=r"profile.start_step=4 is past the run's last step, 3"):
        run(load_sft_config(config), compile=False)
    assert not list(config.with_suffix("").glob("checkpoints/*"))


def test_a_smoke_run_checks_the_config_without_its_later_window(make_config) -> None:
    config = make_config(train={"max_steps": 20}, profile={"start_step": 15})
    run(load_sft_config(config), compile=False, smoke_steps=2)
    smoke_dir = smoke_run_dir(config.with_suffix(""))
    assert "finished at step 2" in (smoke_dir / "train.log").read_text(encoding="utf-8")
    assert not (smoke_dir / "profile").exists()


@pytest.mark.parametrize(("key", "value"), [("start_step", -1), ("steps", 0)])
def test_a_bad_window_is_a_config_error_naming_the_key(make_config, key, value) -> None:
    config = make_config(profile={key: value})
    with pytest.raises(ConfigError, match=rf"profile.{key} must be"):
        load_sft_config(config)


def test_a_profile_that_cannot_be_written_does_not_end_the_run(make_config) -> None:
    config = make_config(train={"max_steps": 3}, profile={"start_step": 1, "steps": 2})
    run_dir = config.with_suffix("")
    run_dir.mkdir()
    (run_dir / "profile").write_text("a file where the profile directory goes\n")
    run(load_sft_config(config), compile=False)
    log = (run_dir / "train.log").read_text(encoding="utf-8")
    assert "profile of steps 1-2 not written: " in log
    assert "finished at step 3" in log
    assert (run_dir / "profile").read_text() == "a file where the profile directory goes\n"


def test_a_window_that_ran_before_a_resume_is_not_profiled_again(tmp_path: Path) -> None:
    profiler = StepProfiler((2, 4), tmp_path, 0, torch.device("cpu"), resumed_at=3)
    for done in range(4, 7):
        profiler.before_step(done)
        profiler.after_step(done)
    profiler.close()
    assert profiler.summary is None and not (tmp_path / "profile").exists()


def test_every_rank_writes_its_own_profile_and_a_stop_keeps_the_steps_taken(
    make_config, harness
) -> None:
    """Two gloo ranks, the window open when SIGTERM arrives: each rank writes the steps the
    job agreed to take, and the run stops as any stopped run does (checkpoint, exit 0)."""
    train = {"max_steps": 40, "control_interval": 100}  # no archive agreement in the window
    config = make_config(train=train, profile={"start_step": 2, "steps": 30})
    job = harness.Job(config, world_size=2)
    job.wait_for_step(4)
    job.signal(signal.SIGTERM)
    job.wait_ok()
    log = (job.run_dir / "train.log").read_text(encoding="utf-8")
    stopped = int(log.split("stopped at step ")[1].split()[0])
    assert 4 <= stopped < 31
    for rank in (0, 1):
        summary = profile_files(job.run_dir, 2, stopped, rank)["summary"]
        assert (summary["first_step"], summary["last_step"]) == (2, stopped)
        # Rank 0 reads the gradient norm and the loss (log_interval 1) as scalars; the agreed
        # status comes back by .tolist(), a copy (on CUDA: among the host's waits). Rank 1 also
        # reads the sizes of what rank 0 broadcasts to it (torch's broadcast_object_list).
        reads = summary["scalar_reads"]
        assert reads == pytest.approx(2) if rank == 0 else reads > 2
    assert (job.run_dir / "checkpoints" / f"step-{stopped:08d}.pt").exists()
