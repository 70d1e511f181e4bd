"""nedolm.dist: process-group setup and rank-safe collectives.

The rule: no rank ever waits in a collective that a failed peer will never enter. Failures
are exchanged inside the collective and raised on every rank; peers that die or hang are
bounded by the process-group timeout.
"""

from nedolm.dist.collectives import (
    CollectiveError,
    RankError,
    all_rank_call,
    barrier,
    broadcast_module_state,
    collect_rank_errors,
    gather_object,
    main_rank_call,
    sum_all,
    sync_control_flags,
)
from nedolm.dist.env import DistEnvError, LaunchEnv, read_launch_env
from nedolm.dist.group import (
    DistInfo,
    cleanup,
    collective_device,
    get_info,
    get_rank,
    get_world_size,
    is_distributed,
    is_main_rank,
    setup_distributed,
)
from nedolm.dist.launcher_watch import LAUNCHER_PID_ENV, watch_launcher
from nedolm.dist.liveness import PeerLostError, lost_ranks, raise_if_peers_lost
from nedolm.dist.log import ON_MAIN_RANK, MainRankFilter

__all__ = [
    "LAUNCHER_PID_ENV",
    "CollectiveError",
    "DistEnvError",
    "DistInfo",
    "LaunchEnv",
    "ON_MAIN_RANK",
    "MainRankFilter",
    "PeerLostError",
    "RankError",
    "all_rank_call",
    "barrier",
    "broadcast_module_state",
    "cleanup",
    "collect_rank_errors",
    "collective_device",
    "gather_object",
    "get_info",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "is_main_rank",
    "lost_ranks",
    "main_rank_call",
    "raise_if_peers_lost",
    "read_launch_env",
    "setup_distributed",
    "sum_all",
    "sync_control_flags",
    "watch_launcher",
]
