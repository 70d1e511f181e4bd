"""One rank of ``nedolm-sft run CONFIG`` under torchrun that counts the collectives it makes.

Each of torch.distributed's collectives is wrapped by a counter that calls the real one (gloo
still runs every reduction); at exit the rank writes its count to ``OUT_DIR/rank-N.json``.
Used by test_stop_each_step.py to show that a stop agreed at every step adds no collective.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "barrier",
)
calls = {"count": 0}


def counted(function: Any) -> Any:
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        calls["count"] += 1
        return function(*args, **kwargs)

    return call


def main(config: Path, out_dir: Path) -> None:
    for name in COLLECTIVES:
        setattr(dist, name, counted(getattr(dist, name)))
    from nedolm.train.config import load_sft_config
    from nedolm.train.trainer import run

    run(load_sft_config(config), compile=False)
    rank = os.environ["RANK"]
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(calls), encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
