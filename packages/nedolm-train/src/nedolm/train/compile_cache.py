"""torch.compile's compiled kernels kept in the run directory, for a start on another machine.

Inductor caches what it compiles on the local disk (``TORCHINDUCTOR_CACHE_DIR``, under /tmp by
default), so a run resumed on the same machine compiles little; resumed on another node (a
preempted job, a new container) its warm-up compiles everything again: code generation, then
C++ or Triton kernel builds, every time. torch's portable cache
(``torch.compiler.save_cache_artifacts``) serialises what this process compiled: inductor's
graphs with their kernels, AOTAutograd's entries. Rank 0 writes it into the run directory
after the first optimizer step (FSDP's one re-trace is done by then), and every start of the
run loads it before its warm-up, so the warm-up finds its graphs in the local cache (a graph
found is recorded again, so the file a resumed run rewrites is as complete as the first). On a
GPU a graph's Triton kernels travel inside its entry (torch bundles them by default:
``bundle_triton_into_fx_graph_cache``); on a CPU its C++ kernels are built again from the
cached source, which is most of a CPU compile: there the file saves nothing measurable
(``bench/compile.py``).

The file is an optimisation, never a requirement: one torch cannot read (damaged, written by
another torch) is named in a warning and the warm-up compiles as it would without it. Entries
are found by torch's own keys (the graph, torch's and Triton's versions, the device), so those
of another kind of machine miss rather than mislead.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from nedolm.data.atomic import atomic_write_bytes

log = logging.getLogger(__name__)

COMPILE_CACHE_FILE = "compile_cache.bin"


def load_compile_cache(run_dir: Path) -> None:
    """Load the run's compile cache, if it has one, into this machine's caches (one torch
    cannot read is warned about and skipped)."""
    path = run_dir / COMPILE_CACHE_FILE
    if not path.is_file():
        return
    try:
        loaded = torch.compiler.load_cache_artifacts(path.read_bytes())
    except OSError as exc:
        log.warning("%s: compile cache not read (%s); the warm-up compiles without it", path, exc)
        return
    if loaded is None:
        log.warning(
            "%s: torch %s cannot read this compile cache (damaged, or written by another torch); "
            "ignored: the warm-up compiles without it, and the run writes a new one",
            path,
            torch.__version__,
        )
        return
    log.info("compile cache: %d entries loaded from %s", _entries(loaded), path)


def save_compile_cache(run_dir: Path) -> None:
    """Write what this process compiled to the run's compile cache (atomically: a reader finds
    the old file or the new). Nothing is written when torch recorded nothing (its caches off);
    a failure is warned about, not raised: training does not need the file."""
    path = run_dir / COMPILE_CACHE_FILE
    try:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            log.info("compile cache: torch recorded nothing to save (its caches are off)")
            return
        data, info = saved
        atomic_write_bytes(path, data)
    except Exception as exc:  # serialising or writing: either way the run trains on
        log.warning("%s: compile cache not written (%s: %s)", path, type(exc).__name__, exc)
        return
    log.info(
        "compile cache: %d entries (%.1f MB) saved to %s, for a start on another machine",
        _entries(info),
        len(data) / 1e6,
        path,
    )


def _entries(info: object) -> int:
    return sum(len(keys) for keys in getattr(info, "artifacts", {}).values())
