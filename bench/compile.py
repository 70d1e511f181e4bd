"""Compile warm-up: each block on its own (the trainer's way) vs the whole model in one graph,
and a resume's warm-up with the run's compile cache.

    python bench/compile.py [--runs 2] [--steps 5] [--layers 24] [--seq-len 512] [--device cpu]
                            [--micro-batch 2] [--resumes-only]

nedolm-0.8b's depth (24 blocks) at a narrow width (d_model 256), so the CPU measures what
depth costs the compiler: a whole-model ``torch.compile`` unrolls every block, compiled blocks
share one traced graph. Each configuration runs in a fresh process with an empty inductor
cache (a warm on-disk cache would hide the cost a user pays at every start on a new machine):
the first forward+backward (the warm-up the trainer logs), then the median training step
(forward, backward, AdamW) on the same micro-batch. Medians over ``--runs`` processes.

Then a resume, after each compiled-blocks process has saved its run's compile cache as the
trainer does (``nedolm.train.compile_cache``): on another machine (an empty inductor cache,
the run's cache loaded first, its load timed) and on the same machine (inductor's local
cache as the first process left it, nothing loaded). ``--resumes-only`` skips the whole-model
and eager processes (on a GPU: ``--device cuda --resumes-only``, about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")

MODES = ("blocks", "model", "eager")
LABELS = {
    "blocks": "compiled blocks (`compile_blocks`, the trainer)",
    "model": "whole model (`torch.compile(model)`)",
    "eager": "eager",
}
RESUMES = {
    "blocks": "first start (empty inductor cache)",
    "other_machine": "resumed on another machine (empty inductor cache, the run's compile cache)",
    "same_machine": "resumed on the same machine (inductor's local cache, nothing loaded)",
}


def child(args: argparse.Namespace) -> dict[str, float]:
    """One configuration in this process: (warm-up s, median step ms)."""
    import torch

    from nedolm.dist import DistInfo
    from nedolm.model import build_model, preset, resolve_attn_impl
    from nedolm.train.compile_cache import load_compile_cache, save_compile_cache
    from nedolm.train.compiling import compile_and_warm_up, warmup_batch
    from nedolm.train.precision import COMPUTE_DTYPES, resolve_precision
    from nedolm.train.step import LossOptions, StepSettings, forward_backward

    device = torch.device(args.device)
    narrow = dict(d_model=256, n_heads=4, n_kv_heads=2, ffn_dim=512, morph_expert_dim=64)
    cfg = preset("nedolm-0.8b", n_layers=args.layers, vocab_size=4096, **narrow)
    compute = resolve_precision("auto", device)  # as a run does, with its default precision
    resolve_attn_impl(cfg.attn_impl, device, COMPUTE_DTYPES[compute])  # probed before compiling
    torch.manual_seed(0)
    with device:
        model = build_model(cfg)
    on_cuda = device.type == "cuda"
    settings = StepSettings(
        DistInfo(0, 1, 0, device),
        eos_id=2,
        grad_accum_steps=1,
        grad_clip=1.0,
        loss=LossOptions(
            assistant_only_head=True, loss_fp32_logits=True, use_amp=compute == "bf16"
        ),
    )
    mb = warmup_batch(cfg.vocab_size, args.micro_batch, args.seq_len, 2, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step_model = torch.compile(model) if args.child == "model" else model

    def step() -> None:
        forward_backward(step_model, mb, settings.loss, 1.0 / mb.targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if on_cuda:
            torch.cuda.synchronize()  # the step's time, not its launch's

    start = time.perf_counter()
    if args.child == "other_machine":
        load_compile_cache(args.run_dir)
    if args.child not in ("model", "eager"):
        assert compile_and_warm_up(model, settings, args.micro_batch, args.seq_len)
    step()
    warmup_s = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    if args.child == "blocks":
        save_compile_cache(args.run_dir)
    return {"warmup_s": warmup_s, "step_ms": 1e3 * statistics.median(times)}


def measure(mode: str, args: argparse.Namespace, run_dir: Path, cache: Path) -> dict[str, float]:
    """``mode`` in a fresh process whose inductor cache is ``cache``."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache)}
    argv = [sys.executable, __file__, "--child", mode, "--run-dir", str(run_dir), *forwarded(args)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_all(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    """Every mode ``--runs`` times; each resume follows the compiled-blocks process whose run
    directory (and, on the same machine, inductor cache) it starts from."""
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in (*MODES, *RESUMES)}
    skipped = ("model", "eager") if args.resumes_only else ()
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            run_dir, first_cache = Path(tmp, "run"), Path(tmp, "machine-1")
            starts = {
                "blocks": first_cache,
                "other_machine": Path(tmp, "machine-2"),
                "same_machine": first_cache,
                "model": Path(tmp, "machine-3"),
                "eager": Path(tmp, "machine-4"),
            }
            for mode, cache in starts.items():
                if mode not in skipped:
                    results[mode].append(measure(mode, args, run_dir, cache))
    return {mode: runs for mode, runs in results.items() if runs}


def forwarded(args: argparse.Namespace) -> list[str]:
    names = ("steps", "layers", "seq_len", "micro_batch", "device")
    return [
        part for name in names for part in (f"--{name.replace('_', '-')}", str(vars(args)[name]))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="processes per configuration")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up")
    parser.add_argument("--layers", type=int, default=24, help="blocks (nedolm-0.8b: 24)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--resumes-only", action="store_true", help="only compiled blocks and their resumes"
    )
    parser.add_argument("--child", choices=(*MODES, *RESUMES), help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    results = measure_all(args)
    warmup = {
        mode: statistics.median(r["warmup_s"] for r in runs) for mode, runs in results.items()
    }
    step = {mode: statistics.median(r["step_ms"] for r in runs) for mode, runs in results.items()}
    print(
        f"{args.layers} blocks, d_model 256, {args.micro_batch}x{args.seq_len} tokens, "
        f"{args.device}, median of {args.runs} fresh processes\n"
    )
    if not args.resumes_only:
        print("| compile | first step s (warm-up) | vs whole model | step ms | vs eager |")
        print("|---|---|---|---|---|")
        for mode in MODES:
            print(
                f"| {LABELS[mode]} | {warmup[mode]:.1f} | {warmup[mode] / warmup['model']:.2f} | "
                f"{step[mode]:.0f} | {step[mode] / step['eager']:.2f} |"
            )
        print()
    print("| compiled blocks | first step s (warm-up) | vs first start |")
    print("|---|---|---|")
    for mode, label in RESUMES.items():
        print(f"| {label} | {warmup[mode]:.1f} | {warmup[mode] / warmup['blocks']:.2f} |")


if __name__ == "__main__":
    main()
