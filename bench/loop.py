"""The SFT loop's own overhead: everything but forward, backward and the optimizer step.

    python bench/loop.py [--steps 20] [--seq-len 256] [--micro-batch 4] [--grad-accum 2]

Builds the embedded sample corpus (apps/sft default: real Turkish chat + its tokenizer), a
random ``tiny`` base run, and a real run (``prepare_run``: contract check, plan, loaders), then
times every step twice over:

* loop step: the time from one ``train_step`` call of ``Trainer.train()`` to the next: the
  loader fetch, the LR schedule, metrics every ``log_interval`` and the control agreement,
  plus the compute;
* compute: that ``train_step`` on its already fetched loader batches: micro-batch assembly
  (labels, packed layout), the target-count agreement, forward, backward, clipping, AdamW.

Overhead = median over steps of (loop step - its compute) / median loop step; measuring both
inside the same step keeps the machine's load out of the difference. Target: <= 3%.
Validation and checkpoints are off: their cost is configured, not per-step overhead.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch
import yaml

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.format import read_special_tokens
from nedolm.dist import get_info
from nedolm.train import loop as loop_module
from nedolm.train.base import init_base
from nedolm.train.config import load_sft_config
from nedolm.train.loop import Trainer
from nedolm.train.metrics import MetricsWriter, setup_logging
from nedolm.train.setup import prepare_run
from nedolm.train.signals import StopRequest
from nedolm.train.step import StepResult, StepSettings, train_step
from nedolm.train.testing import sft_paths

DEFAULT = Path(__file__).resolve().parents[1] / "apps" / "sft" / "src" / "nedolm_sft" / "default"
TARGET = 0.03


def _prepare(root: Path, args: argparse.Namespace) -> Path:
    data, tokenizer = root / "data", root / "tokenizer.json"
    tokenizer.write_bytes(gzip.decompress((DEFAULT / "tokenizer.json.gz").read_bytes()))
    options = BuildOptions(seq_len=args.seq_len, shards=4, val_shards=(3,))
    build_corpus([DEFAULT / "tr_chat_sample.jsonl"], tokenizer, data, options)
    special = read_special_tokens(data)
    init_base(
        root / "base",
        preset_name="tiny",
        vocab_size=special.vocab_size,
        eos_id=special.eos_id,
        overrides={"max_seq_len": args.seq_len},
    )
    config = {
        **sft_paths(root / "run", root / "base", data),
        "optim": {"warmup_steps": 2},
        "train": {
            "seq_len": args.seq_len,
            "micro_batch_size": args.micro_batch,
            "grad_accum_steps": args.grad_accum,
            "max_steps": 10_000,
            "num_workers": args.workers,
            "compile": False,
            "log_interval": 10,
            "control_interval": 20,
            "ckpt_interval": 10_000,
            "archive_interval_hours": 0.0,
        },
        "validation": {"enabled": False},
    }
    path = root / "sft.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_sft_config(_prepare(Path(tmp), args))
        cfg.run_dir.mkdir()
        info = get_info()
        # One step more than timed: the last one ends with the final checkpoint.
        run = prepare_run(cfg, info, smoke_steps=args.warmup + args.steps + 1, allow_compile=False)
        setup_logging(cfg.run_dir)
        trainer = Trainer(run, StopRequest(), MetricsWriter(cfg.run_dir))
        step_starts: list[float] = []
        compute_times: list[float] = []

        def timed_train_step(
            model: torch.nn.Module,
            params: list[torch.Tensor],
            optimizer: torch.optim.Optimizer,
            batches: object,
            settings: StepSettings,
            step: int,
            **options: Any,
        ) -> StepResult:
            step_starts.append(time.perf_counter())
            fetched = [next(batches) for _ in range(settings.grad_accum_steps)]
            started = time.perf_counter()
            result = train_step(model, params, optimizer, iter(fetched), settings, step, **options)
            compute_times.append(time.perf_counter() - started)
            return result

        loop_module.train_step = timed_train_step  # time the compute inside the same step
        trainer.train()
        loop_times = [b - a for a, b in itertools.pairwise(step_starts)][args.warmup :]
        compute_times = compute_times[args.warmup : args.warmup + len(loop_times)]

    loop_ms = 1e3 * statistics.median(loop_times)
    compute_ms = 1e3 * statistics.median(compute_times)
    overhead_ms = 1e3 * statistics.median(
        a - b for a, b in zip(loop_times, compute_times, strict=True)
    )
    overhead = overhead_ms / loop_ms
    print(
        f"tiny preset, CPU x{torch.get_num_threads()} threads, seq_len {args.seq_len}, "
        f"micro-batch {args.micro_batch} x accum {args.grad_accum}, workers {args.workers}, "
        f"{args.steps} steps (medians)"
    )
    print(f"{'measure':<34}{'ms/step':>10}")
    print(f"{'loop step (everything)':<34}{loop_ms:>10.1f}")
    print(f"{'compute (fwd+bwd+clip+AdamW)':<34}{compute_ms:>10.1f}")
    print(f"{'loop overhead (same steps)':<34}{overhead_ms:>10.2f}")
    verdict = "OK" if overhead <= TARGET else "OVER"
    print(f"overhead ratio {100 * overhead:.2f}% (target <= {100 * TARGET:.0f}%): {verdict}")


if __name__ == "__main__":
    main()
