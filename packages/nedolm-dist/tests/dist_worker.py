"""One rank of a multi-process test: ``python dist_worker.py OUT_DIR SCENARIO [ARGS...]``.

Joins the group from the launcher environment conftest.py sets (the same path a torchrun or
SLURM job takes), runs a scenario, and writes what it observed to ``OUT_DIR/rank{N}.json``.
The tests assert on those reports in the parent process.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from nedolm import dist as nd

Report = dict[str, object]


def outcome(fn: Callable[[], object]) -> dict[str, object]:
    """Run ``fn``; record its JSON-able result or its exception type and message, and time."""
    start = time.monotonic()
    try:
        value = fn()
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "seconds": elapsed(start)}
    return {"value": value, "seconds": elapsed(start)}


def elapsed(start: float) -> float:
    return time.monotonic() - start


def failure_sites(world_size: int) -> dict[str, set[int]]:
    return {
        "none": set(),
        "rank0": {0},
        "nonzero": {world_size - 1},
        "all": set(range(world_size)),
    }


class Tiny(torch.nn.Module):
    """Mixed dtypes and a buffer, so a broadcast that skipped or cast anything shows."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, 3)
        self.low = torch.nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
        self.register_buffer("steps", torch.randint(0, 1000, (2,)))


def state_digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        h.update(name.encode())
        h.update(bytes(tensor.flatten().view(torch.uint8).tolist()))  # no numpy in the tox env
    return h.hexdigest()


def collectives(info: nd.DistInfo, out_dir: Path) -> Report:
    """Every helper under every failure site, all in one group (the group stays healthy
    because each injected failure is exchanged inside a collective)."""
    rank, world = info.rank, info.world_size
    report: Report = {
        "info": [info.rank, info.world_size, info.local_rank, str(info.device), info.is_main],
        "get_info": nd.get_info() == info,
        "queries": [nd.get_rank(), nd.get_world_size(), nd.is_main_rank(), nd.is_distributed()],
        "failure_sites": {site: sorted(ranks) for site, ranks in failure_sites(world).items()},
    }
    for site, failing in failure_sites(world).items():
        fails = rank in failing

        def boom(tag: str, fails: bool = fails) -> None:
            if fails:
                raise ValueError(f"{tag} boom on rank {rank}")

        obj = (lambda: None) if fails else {"rank": rank, "square": rank * rank}
        report[f"gather_object/{site}"] = outcome(lambda obj=obj: nd.gather_object(obj))

        ran: list[int] = []

        def on_main(boom=boom, ran=ran) -> dict[str, object]:
            ran.append(rank)
            boom("main")
            return {"computed_on": rank, "items": [1.5, "x", None]}

        report[f"main_rank_call/{site}"] = outcome(
            lambda on_main=on_main: nd.main_rank_call(info, "write things", on_main)
        )
        report[f"main_rank_call/{site}/ran_here"] = bool(ran)

        def local_work(boom=boom) -> int:
            boom("local")
            return rank * 10

        report[f"all_rank_call/{site}"] = outcome(
            lambda local_work=local_work: nd.all_rank_call(info, "load shards", local_work)
        )
        local_error = f"bad input on rank {rank}" if fails else ""
        report[f"collect_rank_errors/{site}"] = outcome(
            lambda local_error=local_error: nd.collect_rank_errors(info, local_error)
        )
        for rank0_archive in (False, True):
            archive_vote = rank0_archive if rank == 0 else not rank0_archive
            report[f"sync_control_flags/{site}/archive={rank0_archive}"] = outcome(
                lambda vote=archive_vote, stop=fails: nd.sync_control_flags(
                    rank0_archive_due=vote, local_stop=stop
                )
            )
        mismatched = Tiny(width=5 + rank if fails else 4)
        report[f"broadcast_module_state/mismatch/{site}"] = outcome(
            lambda m=mismatched: nd.broadcast_module_state(m)
        )

    report["main_rank_call/unpicklable"] = outcome(
        lambda: nd.main_rank_call(info, "return a local lambda", lambda: lambda: 0)
    )

    value = torch.tensor([rank + 1.0, 2.0 * rank])
    counts = torch.tensor([rank, 1], dtype=torch.int64)
    report["sum_all/float"] = outcome(lambda: nd.sum_all(value).tolist())
    report["sum_all/int"] = outcome(lambda: nd.sum_all(counts).tolist())
    report["sum_all/in_place"] = nd.sum_all(value) is value

    for src in (0, world - 1):
        torch.manual_seed(100 * src + rank)
        module = Tiny()
        with torch.no_grad():  # values a lossy or value-based copy would not preserve
            module.proj.weight[0, 0] = float("nan") if rank == src else 1.0
            module.proj.weight[0, 1] = -0.0 if rank == src else 0.0
        report[f"broadcast_module_state/src={src}/before"] = state_digest(module)
        report[f"broadcast_module_state/src={src}"] = outcome(
            lambda m=module, s=src: nd.broadcast_module_state(m, src=s)
        )
        report[f"broadcast_module_state/src={src}/after"] = state_digest(module)

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(rank)s %(levelname)s %(message)s"))
    handler.addFilter(nd.MainRankFilter())
    logger = logging.getLogger(f"nedolm.test.rank{rank}")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logging.getLogger(f"nedolm.test.rank{rank}.child").info("child info")
    logger.info("info")
    logger.warning("warning")
    logger.warning("agreed warning", extra=nd.ON_MAIN_RANK)
    report["log_lines"] = stream.getvalue().splitlines()
    report["barrier"] = outcome(nd.barrier)
    return report


def wait_in_collective(info: nd.DistInfo, out_dir: Path, victim: str, collective: str) -> Report:
    """Ranks other than ``victim`` enter ``collective`` (sum_all or sync_control_flags); the
    victim never does. It idles, like a rank stuck in slow error handling, until the parent
    SIGKILLs it (a dead peer) or the survivors time out (a live, stalled peer)."""
    (out_dir / f"ready{info.rank}").touch()
    if info.rank == int(victim):
        time.sleep(120)
        return {}
    call = {
        "sum_all": lambda: nd.sum_all(torch.ones(3)),
        "sync_control_flags": lambda: nd.sync_control_flags(
            rank0_archive_due=False, local_stop=False
        ),
    }[collective]
    report: Report = {"waited": outcome(call), "error_at": time.time()}
    if "error" in report["waited"]:  # the roll call that names the lost ranks
        failure = nd.CollectiveError(report["waited"]["message"])
        report["lost"] = outcome(lambda: nd.raise_if_peers_lost(failure))
    report["cleanup"] = outcome(nd.cleanup)
    return report


SCENARIOS: dict[str, Callable[..., Report]] = {
    "collectives": collectives,
    "wait_in_collective": wait_in_collective,
}


def main() -> None:
    out_dir, scenario, *args = sys.argv[1:]
    info = nd.setup_distributed()
    report = SCENARIOS[scenario](info, Path(out_dir), *args)
    nd.cleanup()
    nd.cleanup()  # safe to call twice
    report["cleaned_up"] = not nd.is_distributed()
    path = Path(out_dir) / f"rank{info.rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report), encoding="utf-8")
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
