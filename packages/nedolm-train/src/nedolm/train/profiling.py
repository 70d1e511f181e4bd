"""A torch.profiler window of optimizer steps (``profile.start_step``), on every rank.

The first question about a slow GPU run is where a step's time goes: into kernels, or between
them (the host reading the device, launching kernels, waiting for the loader). Each rank writes,
under ``run_dir/profile/steps-A-B/``, a Chrome trace of the window (Perfetto or
chrome://tracing open it), its top ops by self time and a summary per optimizer step: wall
time, the time the device was busy (the union of its ops' intervals), how many device ops ran,
the host's time in synchronizing CUDA calls and its reads of device scalars (each ``.item()``
drains the device's queue). Rank 0 logs its summary.

Profiled steps run slower than the others (every op is recorded), so their metrics lines are
not throughput figures. The window ends with a device synchronization, so every kernel its steps
queued is in the trace and the wall time covers them.
"""

from __future__ import annotations

import gzip
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile

from nedolm.data.atomic import atomic_write, atomic_write_bytes

log = logging.getLogger(__name__)

PROFILE_DIR = "profile"
TOP_OPS = 25
SCALAR_READ = "aten::_local_scalar_dense"
HOST_WAITS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
)
"""CUDA runtime calls in which the host waits for the device."""


@dataclass(frozen=True)
class ProfileSummary:
    """One rank's profiled window, its figures per optimizer step."""

    first_step: int
    last_step: int
    wall_ms: float
    scalar_reads: float
    """``.item()``, ``float()``, ``bool()`` of a tensor (``scalar_reads``): on a GPU each waits
    for the device to drain its queue. A ``.tolist()`` copies instead: on CUDA it is among the
    host's waits."""
    device_busy_ms: float | None
    """The union of the device ops' intervals; None where no device op was recorded (CPU)."""
    device_ops: float | None
    host_wait_ms: float | None

    def describe(self) -> str:
        parts = [f"steps {self.first_step}-{self.last_step}: {self.wall_ms:.1f} ms per step"]
        if self.device_busy_ms is not None:
            busy = self.device_busy_ms / self.wall_ms if self.wall_ms else 0.0
            parts.append(
                f"device busy {self.device_busy_ms:.1f} ms ({busy:.0%}) in "
                f"{self.device_ops:.0f} device ops, host waiting on it {self.host_wait_ms:.1f} ms"
            )
        parts.append(f"{self.scalar_reads:.1f} scalar reads (.item())")
        return ", ".join(parts)


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: ops on several streams overlap."""
    total, covered_to = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= covered_to:
            continue
        total += end - max(start, covered_to)
        covered_to = end
    return total


def scalar_reads(events: Iterable[FunctionEvent]) -> list[FunctionEvent]:
    """The ``aten::_local_scalar_dense`` calls (every ``.item()``, ``int()``, ``bool()`` of a
    tensor, also one made inside another op) outside ``Optimizer.step``: AdamW on a CPU reads
    its step counters there, CUDA's fused AdamW keeps them on the device."""

    def in_optimizer(event: FunctionEvent) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("Optimizer.step"):
                return True
            parent = parent.cpu_parent
        return False

    return [e for e in events if e.name == SCALAR_READ and not in_optimizer(e)]


def summarize(
    events: Iterable[FunctionEvent], first_step: int, last_step: int, wall_s: float
) -> ProfileSummary:
    """The per-step figures of a finished profile's ``events()``, of steps
    ``first_step..last_step`` in ``wall_s`` seconds."""
    steps = last_step - first_step + 1
    events = list(events)
    # A record_function region (``Optimizer.step#AdamW.step``, DDP's forward) also shows on the
    # device's timeline, spanning its first kernel to its last, gaps included: not device work.
    device = [e for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation]
    on_host = [e for e in events if e.device_type == DeviceType.CPU]
    per_step = (first_step, last_step, wall_s * 1e3 / steps, len(scalar_reads(on_host)) / steps)
    if not device:
        return ProfileSummary(*per_step, None, None, None)
    busy_us = busy_time([(e.time_range.start, e.time_range.end) for e in device])
    wait_us = sum(e.time_range.elapsed_us() for e in on_host if e.name in HOST_WAITS)
    return ProfileSummary(
        *per_step, busy_us / 1e3 / steps, len(device) / steps, wait_us / 1e3 / steps
    )


def profile_window(start_step: int, steps: int, max_steps: int) -> tuple[int, int] | None:
    """The (first, last) optimizer steps profiled, 1-based; None when profiling is off or the
    run ends before ``start_step`` (a ``--smoke`` run)."""
    if start_step == 0 or start_step > max_steps:
        return None
    return start_step, min(start_step + steps - 1, max_steps)


class StepProfiler:
    """Profiles the optimizer steps of ``window`` (1-based, inclusive) on this rank.

    The loop calls ``before_step(done)`` and ``after_step(done)`` around each step and
    ``close()`` when it leaves, however it leaves: a window cut short by a stop request is written
    with the steps it holds, before the stop's checkpoint. A failure to write (a full disk) is
    logged, never raised: a diagnostic must not end the run it observes.
    """

    def __init__(
        self,
        window: tuple[int, int] | None,
        run_dir: Path,
        rank: int,
        device: torch.device,
        *,
        resumed_at: int = 0,
    ) -> None:
        self.window = window
        self.run_dir = run_dir
        self.rank = rank
        self.device = device
        self._prof: profile | None = None
        self._first, self._started = 0, 0.0
        self._last_done = 0
        self.summary: ProfileSummary | None = None
        if window is not None and window[0] <= resumed_at:
            log.info(
                "profile: its window starts at step %d, before this resume at step %d; "
                "nothing is profiled",
                window[0],
                resumed_at,
            )
            self.window = None

    def before_step(self, done: int) -> None:
        if self.window is None or done != self.window[0]:
            return
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        # One cycle per window: accumulating across cycles changes nothing, and without it
        # torch 2.10 and 2.11 warn that events are cleared between cycles.
        self._prof = profile(activities=activities, acc_events=True)
        self._prof.start()
        self._first, self._started = done, time.perf_counter()

    def after_step(self, done: int, *, last: bool = False) -> None:
        """After step ``done``'s update; ``last``: the run stops after it (an agreed stop)."""
        if self._prof is None:
            return
        self._last_done = done
        if last or (self.window is not None and done >= self.window[1]):
            self.close()

    def close(self) -> None:
        """Stop a window in progress and write the steps it holds; never raises (it also runs
        while the loop's own exception propagates)."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        self.window = None  # one window per run
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            wall_s = time.perf_counter() - self._started
            prof.stop()
            if self._last_done < self._first:
                return  # left inside its first step: no whole step to show
            self.summary = summarize(prof.events(), self._first, self._last_done, wall_s)
            out = self.run_dir / PROFILE_DIR / f"steps-{self._first}-{self._last_done}"
            write_profile(prof, self.summary, out, self.rank)
        except Exception as exc:
            log.warning("profile of steps %d-%d not written: %s", self._first, self._last_done, exc)
            return
        if self.rank == 0:
            log.info("profile (rank 0) of %s; written to %s", self.summary.describe(), out)


def write_profile(prof: profile, summary: ProfileSummary, out: Path, rank: int) -> None:
    """``rank{R}.trace.json.gz``, ``rank{R}.ops.txt`` and ``rank{R}.summary.json`` in ``out``,
    each whole or absent."""
    by_device = summary.device_busy_ms is not None
    table = prof.key_averages().table(
        sort_by="self_device_time_total" if by_device else "self_cpu_time_total",
        row_limit=TOP_OPS,
        max_name_column_width=80,
    )
    atomic_write_bytes(out / f"rank{rank}.ops.txt", f"{summary.describe()}\n\n{table}\n".encode())
    with tempfile.TemporaryDirectory(prefix="nedolm-profile-") as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        with trace.open("rb") as source:
            atomic_write(
                out / f"rank{rank}.trace.json.gz",
                lambda handle: _gzip_into(source, handle),
            )
    summary_json = json.dumps({**asdict(summary), "rank": rank}, indent=1)
    atomic_write_bytes(out / f"rank{rank}.summary.json", summary_json.encode())


def _gzip_into(source: IO[bytes], handle: IO[bytes]) -> None:
    with gzip.GzipFile(fileobj=handle, mode="wb", mtime=0) as packed:
        shutil.copyfileobj(source, packed)
