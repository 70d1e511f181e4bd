"""Launcher environment parsing: who am I, how many are we, where is the rendezvous.

Kept free of process-group calls so every rule (torchrun first, then SLURM, then single
process; which variables are required; how the timeout is chosen) is a pure function of the
environment mapping and can be tested without starting a group.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass

TIMEOUT_ENV = "NEDOLM_DIST_TIMEOUT_S"
# Long enough for the slowest rank-0 action the others wait on (hashing every shard, reading
# a 0.8B base checkpoint, compile warm-up); short enough that a lost peer ends the job.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
_MAX_TIMEOUT_S = 365 * 24 * 3600.0  # rejects inf/nan, which timedelta cannot hold

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
_RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT")


class DistEnvError(RuntimeError):
    """The launcher environment is incomplete or malformed; the message names the variable."""


@dataclass(frozen=True, slots=True)
class LaunchEnv:
    """One process's place in a multi-process launch, as the launcher described it."""

    rank: int  # global rank, 0 <= rank < world_size
    world_size: int  # number of processes in the job
    local_rank: int  # index of this process on its node; selects the CUDA device
    launcher: str  # "torchrun" or "slurm", for error messages


def read_launch_env(environ: Mapping[str, str]) -> LaunchEnv | None:
    """Parse torchrun or SLURM variables; None means a plain single process.

    torchrun wins when both are present (torchrun inside a SLURM allocation sets its own
    RANK/WORLD_SIZE). A one-task SLURM step (an interactive ``salloc`` shell) is a single
    process, so it does not demand a rendezvous address.

    Raises:
        DistEnvError: a required variable is missing or not a valid integer, or the ranks
            are inconsistent.
    """
    if any(name in environ for name in _TORCHRUN_VARS[:2]):
        launcher, names = "torchrun", _TORCHRUN_VARS
    elif "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        launcher, names = "slurm", _SLURM_VARS
        if _int_var(environ, "SLURM_NTASKS", launcher) == 1:
            return None
    else:
        return None
    rank, world_size, local_rank = (_int_var(environ, name, launcher) for name in names)
    for name in _RENDEZVOUS_VARS:
        if not environ.get(name):
            raise DistEnvError(f"{launcher} launch: environment variable {name} is not set")
    _int_var(environ, "MASTER_PORT", launcher)
    if world_size < 1:
        raise DistEnvError(f"{launcher} launch: {names[1]}={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise DistEnvError(f"{launcher} launch: {names[0]}={rank} is outside [0, {world_size})")
    if local_rank < 0:
        raise DistEnvError(f"{launcher} launch: {names[2]}={local_rank} must be >= 0")
    return LaunchEnv(rank, world_size, local_rank, launcher)


def resolve_timeout(
    timeout: datetime.timedelta | float | None, environ: Mapping[str, str]
) -> datetime.timedelta:
    """Collective timeout: the argument, else ``NEDOLM_DIST_TIMEOUT_S``, else 30 minutes.

    Raises:
        DistEnvError: the environment value is not a positive number.
        ValueError: the argument is not positive.
    """
    if timeout is None:
        raw = environ.get(TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT
        try:
            seconds = float(raw)
        except ValueError:
            raise DistEnvError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
        if not 0 < seconds < _MAX_TIMEOUT_S:
            raise DistEnvError(f"{TIMEOUT_ENV}={raw!r} must be a finite number > 0 of seconds")
        return datetime.timedelta(seconds=seconds)
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if not 0 < seconds < _MAX_TIMEOUT_S:
        raise ValueError(f"distributed timeout must be a finite number > 0 of seconds, got {timeout}")
    return datetime.timedelta(seconds=seconds)


def _int_var(environ: Mapping[str, str], name: str, launcher: str) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        raise DistEnvError(f"{launcher} launch: environment variable {name} is not set")
    try:
        return int(raw)
    except ValueError:
        raise DistEnvError(f"{launcher} launch: {name}={raw!r} is not an integer") from None
