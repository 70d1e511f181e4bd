"""``python -m nedolm.train CONFIG [--smoke-steps N] [--no-compile]`` (also under torchrun).

The same entry as ``nedolm-sft run``, without the CLI app: handy under launchers that start a
Python module.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nedolm.train.signals import StopRequest


def main() -> None:
    # Before torch is imported (seconds): a SIGTERM during startup is kept, not fatal.
    stop = StopRequest().install()
    from nedolm.train.config import check_run_paths, load_sft_config
    from nedolm.train.trainer import run

    parser = argparse.ArgumentParser(prog="python -m nedolm.train", description=__doc__)
    parser.add_argument("config", type=Path)
    parser.add_argument("--smoke-steps", type=int, default=None)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    cfg = load_sft_config(args.config)
    check_run_paths(cfg)
    run(cfg, smoke_steps=args.smoke_steps, compile=not args.no_compile, stop=stop)


if __name__ == "__main__":
    main()
