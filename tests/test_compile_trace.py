"""``bench/compile_trace.py`` reads the compile metrics that torch writes under ``TORCH_TRACE``:
a real compile in a real process, traced twice over one inductor cache (a miss, then a hit)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
COMPILE = """
import torch
layer = torch.nn.Linear(32, 32)
step = torch.compile(lambda x: torch.nn.functional.gelu(layer(x)).sum())
step(torch.randn(4, 32, requires_grad=True)).backward()
"""


def compile_trace():
    spec = importlib.util.spec_from_file_location("compile_trace", BENCH / "compile_trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def traced_compile(trace: Path, cache: Path) -> None:
    env = {**os.environ, "TORCH_TRACE": str(trace), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    env["OMP_NUM_THREADS"] = "1"
    subprocess.run([sys.executable, "-c", COMPILE], env=env, check=True, timeout=240)


def test_each_compiled_graph_is_a_row_with_its_phases_and_cache_use(tmp_path: Path) -> None:
    reader = compile_trace()
    cache = tmp_path / "inductor"
    traced_compile(tmp_path / "cold", cache)
    traced_compile(tmp_path / "warm", cache)
    cold = reader.compilations(tmp_path / "cold")
    assert [r["pass"] for r in cold] == ["forward", "backward"]
    assert cold[0]["graph_op_count"] >= 2  # the linear and the gelu at least
    assert all(r["duration_us"] > 0 for r in cold)
    table = reader.summary(tmp_path / "cold")
    rows = [line for line in table.splitlines() if "| 0/0 |" in line]
    assert rows[0].startswith("| 0.0 |")  # the first compile starts the clock
    assert len(rows) == 2 and "2 compiled graph(s)" in table, table
    warm = reader.table(reader.compilations(tmp_path / "warm"))
    if "inductor_fx_local_cache_miss_count" in cold[0]:  # torch >= 2.11 counts cache use
        assert "fx 0 hit/1 miss" in rows[0], table
        # AOTAutograd's cache hands back both passes, each from inductor's: nothing compiled.
        assert "aot 1 hit/0 miss" in warm and "backward" not in warm, warm
    else:  # torch 2.10 records no counts: the column says so rather than "0 hits"
        assert all(row.endswith("| - |") for row in rows), table
    assert (
        reader.summary(tmp_path / "absent")
        == f"no compilation recorded under {tmp_path / 'absent'}"
    )
