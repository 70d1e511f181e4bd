"""A compiled run keeps its kernels in the run directory: resumed where the machine's own
inductor cache is empty (another node, a new container), the warm-up finds its graphs there
instead of compiling them; a cache torch cannot read is named and costs only the compile.

Each start is a real process with its own empty ``TORCHINDUCTOR_CACHE_DIR``, as on a fresh
machine; inductor (not ``aot_eager``) compiles, as a user's run does.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from nedolm.train.compile_cache import COMPILE_CACHE_FILE

# Inductor's imports warn (in this process: the second test compiles here).
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)
WARM_UP = re.compile(r"inductor's cache: (\d+) graph\(s\) found, (\d+) compiled")
SAVED = re.compile(r"compile cache: (\d+) entries \([\d.]+ MB\) saved to ")


def _start(harness: SimpleNamespace, config: Path, inductor_cache: Path) -> str:
    """One process on a machine whose inductor cache is ``inductor_cache``; its log."""
    job = harness.Job(config, env={"TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)})
    job.wait_ok()
    return job.output()


def _logged(line: re.Pattern[str], output: str) -> tuple[int, ...]:
    """The numbers ``line`` captures in a run's log (which must have it)."""
    match = line.search(output)
    assert match, output[-3000:]
    return tuple(int(number) for number in match.groups())


def _found_and_compiled(output: str) -> tuple[int, ...]:
    return _logged(WARM_UP, output)


def _saved_entries(output: str) -> int:
    return _logged(SAVED, output)[0]


def test_a_run_resumed_on_a_fresh_machine_finds_its_compiled_graphs_in_the_run_dir(
    harness: SimpleNamespace, make_config, tmp_path: Path
) -> None:
    compiled = {"compile": True, "compile_backend": "inductor", "grad_accum_steps": 1}
    config = make_config(train={**compiled, "max_steps": 2})
    run_dir = config.with_suffix("")
    cache = run_dir / COMPILE_CACHE_FILE

    first = _start(harness, config, tmp_path / "machine-1")
    found, compiled_graphs = _found_and_compiled(first)
    assert found == 0 and compiled_graphs > 0, first[-3000:]
    assert cache.is_file() and cache.stat().st_size > 0
    assert not [p.name for p in run_dir.iterdir() if ".tmp-" in p.name]

    # Extended on another machine: everything the warm-up needs comes from the run's cache.
    config = make_config(train={**compiled, "max_steps": 3})
    resumed = _start(harness, config, tmp_path / "machine-2")
    assert "compile cache:" in resumed and "entries loaded from" in resumed, resumed[-3000:]
    assert _found_and_compiled(resumed) == (compiled_graphs, 0), resumed[-3000:]
    # What it found is saved again (torch records a hit as it records a compile), so the
    # rewritten cache is as complete as the first.
    assert _saved_entries(resumed) == _saved_entries(first) > 0

    # A damaged cache: named, ignored, the warm-up compiles, the run trains and rewrites it.
    damaged = cache.read_bytes()
    cache.write_bytes(damaged[: len(damaged) // 2])
    config = make_config(train={**compiled, "max_steps": 4})
    after_damage = _start(harness, config, tmp_path / "machine-3")
    assert f"{cache}: torch" in after_damage and "cannot read" in after_damage, after_damage
    assert _found_and_compiled(after_damage) == (0, compiled_graphs), after_damage[-3000:]
    assert "finished at step 4" in after_damage
    rewritten = cache.read_bytes()
    assert len(rewritten) > len(damaged) // 2

    # train.compile_cache: false (a run directory from elsewhere): not loaded, not rewritten.
    config = make_config(train={**compiled, "max_steps": 5, "compile_cache": False})
    without = _start(harness, config, tmp_path / "machine-4")
    assert "compile cache" not in without and "finished at step 5" in without, without[-3000:]
    assert _found_and_compiled(without) == (0, compiled_graphs)
    assert cache.read_bytes() == rewritten


def test_a_compile_cache_that_cannot_be_written_is_warned_about_and_training_needs_none(
    tmp_path: Path, caplog
) -> None:
    """Where ``compile_cache.bin`` cannot be written (here a directory holds its name) the
    save warns naming it, raises nothing and leaves no temporary file; the load skips what is
    not a file. In a real process's own dir the same save writes a cache the load reads."""
    import torch

    from nedolm.train.compile_cache import load_compile_cache, save_compile_cache

    torch.compile(lambda x: torch.sin(x) * 2)(torch.randn(8))  # something for torch to record
    blocked = tmp_path / "blocked"
    (blocked / COMPILE_CACHE_FILE).mkdir(parents=True)
    with caplog.at_level("INFO", logger="nedolm.train.compile_cache"):
        save_compile_cache(blocked)
        load_compile_cache(blocked)
    assert f"{blocked / COMPILE_CACHE_FILE}: compile cache not written" in caplog.text
    assert sorted(p.name for p in blocked.iterdir()) == [COMPILE_CACHE_FILE]
    assert "loaded" not in caplog.text

    caplog.clear()
    with caplog.at_level("INFO", logger="nedolm.train.compile_cache"):
        save_compile_cache(tmp_path)
        load_compile_cache(tmp_path)
    assert (tmp_path / COMPILE_CACHE_FILE).is_file()
    assert re.search(r"compile cache: [1-9]\d* entries loaded from", caplog.text), caplog.text
