"""Test hooks that make a real code path fail or stall on one rank, for failure-path tests.

Both are read from the environment at every call, cost one dict lookup when unset, and do
nothing in production runs:

- ``NEDOLM_TEST_FAULT="phase@rank[,phase@rank...]"`` raises ``InjectedFault`` at ``phase`` on
  that rank (``*`` = every rank), e.g. ``data_fetch@1``.
- ``NEDOLM_TEST_DELAY="phase=seconds[,...]"`` sleeps at ``phase`` on every rank, so that a test
  can deliver a signal while the job is inside that phase.

Phases: ``compile_warmup``, ``data_fetch``, ``validation``, ``checkpoint_write`` (before a save
writes anything), ``checkpoint_commit`` (a checkpoint file is written under its temporary name,
not yet fsynced nor renamed: under ``train.async_checkpoint`` on the background writer, while
training goes on), ``sharded_finish`` (inside a sharded save: every shard is on disk in the
temporary directory, the manifest not yet) and ``staging_reserve`` (rank 0's background
reservation of async-checkpoint buffers, before it allocates).
"""

from __future__ import annotations

import os
import time

PHASES = (
    "compile_warmup",
    "data_fetch",
    "validation",
    "checkpoint_write",
    "checkpoint_commit",
    "sharded_finish",
    "staging_reserve",
)


class InjectedFault(RuntimeError):
    """Raised where NEDOLM_TEST_FAULT asks for it."""


def _entries(variable: str, sep: str) -> dict[str, str]:
    raw = os.environ.get(variable, "")
    out = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        phase, _, value = item.partition(sep)
        if phase not in PHASES or not value:
            raise ValueError(f"{variable}: bad entry {item!r}; phases are {PHASES}")
        out[phase] = value
    return out


def maybe_inject(phase: str, rank: int) -> None:
    """Sleep and/or raise at ``phase`` when the test environment asks for it."""
    delay = _entries("NEDOLM_TEST_DELAY", "=").get(phase)
    if delay is not None:
        time.sleep(float(delay))
    target = _entries("NEDOLM_TEST_FAULT", "@").get(phase)
    if target is not None and target in ("*", str(rank)):
        raise InjectedFault(f"injected fault at {phase} on rank {rank}")
