"""Where a process's torch.compile time went, from the structured trace that ``TORCH_TRACE=DIR``
makes torch write (the files tlparse reads): one row per compiled graph, forward and backward.

    python bench/compile_trace.py DIR [--title TEXT]

bench/gpu.sh traces (b) and (c) this way: on the H200, (c)'s compile warm-up took 62-76 s while
(b) compiled the same block in 7-10 s, and neither log said which phase took the time (dynamo's
trace, AOTAutograd, inductor's code generation, Triton's kernel builds) or whether a cache hit.
The metrics are torch's own ``compilation_metrics`` records; a field an older torch lacks prints
as "-".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RECORDS = ("compilation_metrics", "bwd_compilation_metrics")


def compilations(trace_dir: Path) -> list[dict]:
    """Every compilation_metrics record under ``trace_dir`` (one file per traced process), by
    start time, each with ``pass`` set to "forward" or "backward"."""
    found = []
    for path in sorted(trace_dir.glob("*.log")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            for name in RECORDS:
                start = line.find('{"' + name + '"')
                if start >= 0:
                    record = json.loads(line[start:])[name]
                    record["pass"] = "backward" if name.startswith("bwd") else "forward"
                    found.append(record)
    return sorted(found, key=lambda record: record.get("start_time") or 0.0)


def _seconds(record: dict, key: str) -> str:
    """A duration field, in seconds whichever unit torch wrote it in."""
    if record.get(key + "_s") is not None:
        return f"{record[key + '_s']:.1f}"
    if record.get(key + "_us") is not None:
        return f"{record[key + '_us'] / 1e6:.1f}"
    return "-"


def _cache_count(record: dict, prefix: str, outcome: str) -> int:
    """A cache's ``outcome`` ("hit" or "miss") count, local and remote together."""
    return sum(
        record.get(f"{prefix}_{where}_cache_{outcome}_count") or 0 for where in ("local", "remote")
    )


def _cache(record: dict) -> str:
    """Inductor's FX graph cache and AOTAutograd's cache: hits/misses, local and remote."""
    parts = []
    for label, prefix in (("fx", "inductor_fx"), ("aot", "aotautograd")):
        hits = _cache_count(record, prefix, "hit")
        misses = _cache_count(record, prefix, "miss")
        if hits or misses:
            parts.append(f"{label} {hits} hit/{misses} miss")
    return ", ".join(parts) or "-"


def table(records: list[dict]) -> str:
    """Markdown: one row per compiled graph (its start counted from the first's), then the
    total."""
    lines = [
        "| started at s | compile id | pass | frame | graph ops | whole s | AOTAutograd s "
        "| inductor s | code gen s | Triton builds s | caches |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    total_us = 0
    first = min((r["start_time"] for r in records if r.get("start_time")), default=None)
    for r in records:
        total_us += r.get("duration_us") or 0
        frame = f"{r['co_name']}" if r.get("co_name") else "-"
        whole = "entire_frame_compile_time" if r["pass"] == "forward" else "duration"
        started = f"{r['start_time'] - first:.1f}" if r.get("start_time") and first else "-"
        lines.append(
            f"| {started} | {r.get('compile_id', '-')} | {r['pass']} | {frame} "
            f"| {r.get('graph_op_count') or '-'} | {_seconds(r, whole)} "
            f"| {_seconds(r, 'backend_compile_time')} | {_seconds(r, 'inductor_compile_time')} "
            f"| {_seconds(r, 'code_gen_time')} | {_seconds(r, 'triton_compile_time')} "
            f"| {_cache(r)} |"
        )
    lines.append(f"\n{len(records)} compiled graph(s), {total_us / 1e6:.1f} s in all")
    return "\n".join(lines)


def summary(trace_dir: Path) -> str:
    """The table, or why there is none."""
    records = compilations(trace_dir) if trace_dir.is_dir() else []
    return table(records) if records else f"no compilation recorded under {trace_dir}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--title", default="compile time by phase (TORCH_TRACE)")
    args = parser.parse_args()
    print(f"### {args.title}\n\n{summary(args.trace_dir)}\n")


if __name__ == "__main__":
    main()
