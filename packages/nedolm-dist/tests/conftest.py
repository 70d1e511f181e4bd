"""Launch real process groups: one OS process per rank running dist_worker.py.

Each rank gets the environment a launcher would give it (torchrun or SLURM variables,
MASTER_ADDR/MASTER_PORT on localhost), writes its observations to ``rank{N}.json`` and
exits. Every wait has a hard deadline; leftovers are SIGKILLed at teardown, so a hang fails
its test instead of blocking CI.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("dist_worker.py")
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Group:
    """A running group of rank processes and the folder they report into."""

    def __init__(
        self, argv: list[str], world_size: int, out_dir: Path, timeout_s: float, launcher: str
    ) -> None:
        self.out_dir = out_dir
        self.world_size = world_size
        base = {
            k: v
            for k, v in os.environ.items()
            if k not in _LAUNCH_VARS and not k.startswith("SLURM_")
        }
        base.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            NEDOLM_DIST_TIMEOUT_S=str(timeout_s),
            OMP_NUM_THREADS="1",
            CUDA_VISIBLE_DEVICES="",  # these are gloo tests, also on a GPU runner
        )
        self.procs: list[subprocess.Popen] = []
        for rank in range(world_size):
            env = dict(base)
            if launcher == "torchrun":
                env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
            else:
                env.update(
                    SLURM_PROCID=str(rank), SLURM_NTASKS=str(world_size), SLURM_LOCALID=str(rank)
                )
            log = (out_dir / f"rank{rank}.log").open("w", encoding="utf-8")
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(out_dir), *argv],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            log.close()

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill_all()

    def wait_for_file(self, name: str, deadline_s: float) -> None:
        """Block until ``out_dir/name`` exists; fail the test after ``deadline_s``."""
        end = time.monotonic() + deadline_s
        while not (self.out_dir / name).exists():
            if time.monotonic() > end:
                pytest.fail(f"{name} did not appear within {deadline_s}s\n{self.logs()}")
            time.sleep(0.05)

    def wait(self, ranks: list[int], deadline_s: float) -> None:
        """Wait for ``ranks`` to exit; fail the test (and kill everyone) after ``deadline_s``."""
        end = time.monotonic() + deadline_s
        for rank in ranks:
            try:
                self.procs[rank].wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill_all()
                pytest.fail(f"rank {rank} still running after {deadline_s}s\n{self.logs()}")

    def kill(self, rank: int) -> None:
        self.procs[rank].send_signal(signal.SIGKILL)
        self.procs[rank].wait(timeout=10)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)

    def report(self, rank: int) -> dict:
        path = self.out_dir / f"rank{rank}.json"
        if not path.exists():
            pytest.fail(f"rank {rank} wrote no report\n{self.logs()}")
        return json.loads(path.read_text(encoding="utf-8"))

    def reports(self) -> list[dict]:
        return [self.report(rank) for rank in range(self.world_size)]

    def logs(self) -> str:
        return "\n".join(
            f"--- rank {rank} (exit {proc.poll()}) ---\n"
            + (self.out_dir / f"rank{rank}.log").read_text(encoding="utf-8")[-3000:]
            for rank, proc in enumerate(self.procs)
        )


@pytest.fixture(scope="session")
def start_group() -> Callable[..., Group]:
    """``start_group(out_dir, world_size, *argv, timeout_s=30, launcher="torchrun")``.

    Use the result as a context manager: leaving it SIGKILLs any rank still running.
    """

    def _start(
        out_dir: Path,
        world_size: int,
        *argv: str,
        timeout_s: float = 30.0,
        launcher: str = "torchrun",
    ) -> Group:
        out_dir.mkdir(parents=True, exist_ok=True)
        return Group(list(argv), world_size, out_dir, timeout_s, launcher)

    return _start


@pytest.fixture
def master_port() -> int:
    return free_port()
