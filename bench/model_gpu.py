"""CUDA benchmark of nedolm-model (run by bench/gpu.sh).

0. Each attention backend's start-up probe (forward + backward on tiny inputs) and what
   `attn_impl: auto` therefore picks on this device.
1. Backend agreement in bf16: every present attention backend (flash, torch_varlen, flex)
   against `sdpa` on the same packed rows: logits, fused-head loss and every gradient. Each
   backend runs on its own: one that fails prints its error row and the others still run.
2. Training-step tokens/s and MFU of a preset (default nedolm-0.8b) at seq_len 4096 on rows
   packed with conversations of the real corpus' lengths (bench/packing_lengths.json: ~20 a
   row, most short; the attention kernels' work depends on it), 40% targets, for each backend
   whose probe passed, eager and compiled (each block compiled on its own: one compiled graph
   serves all blocks, so compile takes seconds, not minutes); a failing configuration prints
   its error row. Right after `auto`'s backend come the variants under evaluation, compiled:
   `grouped` morph dispatch (grouped GEMMs, the FLOPs the MFU counts) against the preset's
   `masked`, and, when torch_varlen takes grouped KV heads unexpanded (torch 2.10/2.11 after
   its probe), torch_varlen with them copied per query head as before: each gain measured in
   the same run. Each row gives its median step and its spread (interquartile range / median);
   the backend and the morph dispatch whose compiled steps were fastest beyond that spread (and
   2%) are written for the trainer's run (--faster-backend-to, --faster-dispatch-to).

MFU uses the project's one FLOP count, `nedolm.train.flops.flops_per_token` (its docstring
states the convention: 6 x matmul weights per token + the full-row attention term), so it
compares with the trainer's own `mfu`.
`--device cpu --preset tiny --seq-len 256` smoke-tests the script on a laptop.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from nedolm.data import synthetic
from nedolm.model import (
    ModelConfig,
    attention_backends,
    build_model,
    packed_layout,
    preset,
    probe_backends,
    resolve_attn_impl,
    varlen_gqa_mode,
)
from nedolm.model.attention import set_varlen_native_gqa
from nedolm.model.attn_select import auto_order
from nedolm.model.config import MORPH_DISPATCHES
from nedolm.train.flops import flops_per_token, peak_bf16_flops

TARGET_FRACTION, EOS_ID = 0.4, 2
LENGTHS_FILE = Path(__file__).with_name("packing_lengths.json")
NOISE = 0.02  # a step time within 2% of another is not a measured difference


class StepTime(NamedTuple):
    """A configuration's step: the median of the timed steps and their interquartile range
    relative to it, the run-to-run noise this run measured for that row."""

    median_s: float
    spread: float

    @classmethod
    def of(cls, times: list[float]) -> StepTime:
        median = statistics.median(times)
        if len(times) < 2:
            return cls(median, 0.0)
        q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
        return cls(median, (q3 - q1) / median)


def conversation_lengths(n: int, seed: int) -> list[int]:
    """Token lengths of ``n`` conversations drawn from the real chat corpus' histograms
    (``bench/packing_lengths.json``: turns and per-role message lengths, real tokenizer)."""
    params = json.loads(LENGTHS_FILE.read_text(encoding="utf-8"))
    index, _ = synthetic.layout(synthetic.sample_conversations(params, n, seed))
    return index["token_len"].tolist()


def packed_rows(cfg: ModelConfig, batch: int, seq_len: int, device: str, seed: int = 0):
    """Rows packed back to back with conversations of the real corpus' lengths, EOS-separated,
    40% targets; one that overflows a row goes on at the start of the next (as a corpus's
    continuation windows do), so no row ends in padding.

    The segment count and lengths set the attention kernels' work: at seq_len 4096 the real
    corpus puts ~20 conversations in a row, most of a few dozen tokens, a few of thousands.
    """
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, cfg.vocab_size, (batch * seq_len,), generator=gen)
    # Conversations of at least 4 tokens (header, end) fill the rows many times over.
    ends = torch.tensor(conversation_lengths(batch * seq_len // 4, seed)).cumsum(0)
    ends = ends[ends < batch * seq_len]
    input_ids[ends - 1] = EOS_ID
    input_ids = input_ids.view(batch, seq_len)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen)
    labels[torch.rand(batch, seq_len, generator=gen) >= TARGET_FRACTION] = -100
    cu_seqlens, position_ids = packed_layout(input_ids, EOS_ID)
    segments = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    layout = dict(
        cu_seqlens=cu_seqlens.to(device),
        max_seqlen=int(segments.max()),
        position_ids=position_ids.to(device),
    )
    return input_ids.to(device), labels.to(device), layout, segments


def build(cfg: ModelConfig, backend: str, device: str, state: dict | None = None):
    torch.manual_seed(0)
    with torch.device(device):  # initialise in place: 0.8B normal_ draws on CPU take seconds
        model = build_model(dataclasses.replace(cfg, attn_impl=backend))
    if cfg.n_morph_classes:
        classes = torch.randint(0, cfg.n_morph_classes, (cfg.vocab_size,))
        model.set_morph_classes(classes)
    if state is not None:
        model.load_state_dict(state)
    return model


def loss_grads_logits(model, input_ids, labels, layout, device: str):
    model.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss, _ = model(input_ids, labels, return_logits=False, loss_reduction="sum", **layout)
    loss.backward()
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
        _, logits = model(input_ids, **layout)
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    return loss.detach().float(), grads, logits.float()


def agreement(cfg: ModelConfig, backends: list[str], seq_len: int, device: str) -> None:
    cfg = dataclasses.replace(cfg, n_layers=2)
    batch = packed_rows(cfg, 2, seq_len, device, seed=1)[:3]
    ref_model = build(cfg, "sdpa", device)
    state = ref_model.state_dict()
    ref_loss, ref_grads, ref_logits = loss_grads_logits(ref_model, *batch, device)
    print(f"## Backend agreement vs sdpa, bf16 autocast, 2 layers, 2x{seq_len} packed tokens\n")
    print("| backend | max abs logit diff / max abs logit | loss rel diff | worst grad rel diff |")
    print("|---|---|---|---|")
    for backend in backends:
        if backend == "sdpa":
            continue
        try:
            model = build(cfg, backend, device, state)
            loss, grads, logits = loss_grads_logits(model, *batch, device)
        except Exception as error:  # one broken backend must not hide the others' rows
            print(f"| {backend} | error: {_first_line(error)} | | |", flush=True)
            continue
        logit_err = float((logits - ref_logits).abs().max() / ref_logits.abs().max())
        loss_err = float((loss - ref_loss).abs() / ref_loss.abs())
        grad_err = max(float((grads[n] - g).norm() / g.norm()) for n, g in ref_grads.items())
        print(f"| {backend} | {logit_err:.2e} | {loss_err:.2e} | {grad_err:.2e} |", flush=True)
    print("\n(bf16 rounding: expect <= ~2e-2 everywhere; larger means a backend bug)\n")


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}"[:200].replace("|", "/")


def throughput(
    cfg: ModelConfig,
    backend: str,
    compiled: bool,
    args: argparse.Namespace,
    peak_tflops: float,
    label: str,
    batch: tuple[torch.Tensor, torch.Tensor, dict],
) -> tuple[str, StepTime]:
    """(the table row, the step's median and spread) of training on ``batch``, the
    (input_ids, labels, layout) that every row shares."""
    model = build(cfg, backend, args.device)
    if compiled:
        model.compile_blocks()  # as the trainer does; not fullgraph: older flash-attn builds break
    fused = args.device == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)
    input_ids, labels, layout = batch

    def step() -> None:
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss, _ = model(input_ids, labels, return_logits=False, loss_reduction="sum", **layout)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    start = time.perf_counter()
    step()  # compile and allocator warm-up
    _sync(args.device)
    compile_s = time.perf_counter() - start if compiled else 0.0
    step()
    times = []
    for _ in range(args.steps):
        _sync(args.device)
        start = time.perf_counter()
        step()
        _sync(args.device)
        times.append(time.perf_counter() - start)
    timed = StepTime.of(times)
    secs = timed.median_s
    tokens = input_ids.numel()
    flops = tokens * flops_per_token(cfg, args.seq_len)
    mfu = f"{flops / secs / (peak_tflops * 1e12):.1%}" if peak_tflops else "n/a"
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0
    mode = "compiled" if compiled else "eager"
    row = (
        f"| {label} | {mode} | {secs * 1e3:.0f} | {timed.spread:.1%} | {tokens / secs:,.0f} | "
        f"{mfu} | {compile_s:.0f} | {peak_mem:.1f} |"
    )
    return row, timed


@contextlib.contextmanager
def kv_heads_copied() -> Iterator[None]:
    """torch_varlen with a copy of K and V per query head, the same run's reference."""
    set_varlen_native_gqa(False)
    try:
        yield
    finally:
        set_varlen_native_gqa(True)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="nedolm-0.8b")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dispatch", default="masked", choices=MORPH_DISPATCHES)
    parser.add_argument("--peak-tflops", type=float, default=None, help="bf16 dense peak")
    parser.add_argument("--budget-s", type=float, default=420, help="skip configs after this")
    parser.add_argument(
        "--faster-backend-to",
        type=Path,
        help="write the trainable attention backend whose compiled step was fastest here "
        "(bench/gpu.sh hands it to the trainer's run)",
    )
    parser.add_argument(
        "--faster-dispatch-to",
        type=Path,
        help="write the morph dispatch whose compiled step was faster here (bench/gpu.sh hands "
        "it to the trainer's run)",
    )
    args = parser.parse_args()
    began = time.perf_counter()
    cfg = preset(args.preset, morph_dispatch=args.dispatch, max_seq_len=args.seq_len)
    present = [name for name, why in attention_backends(args.device).items() if why is None]
    peak = args.peak_tflops
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    if peak is None:
        peak = (peak_bf16_flops(name) or 0.0) / 1e12
    print(f"device {name}, torch {torch.__version__}, peak bf16 {peak or 'unknown'} TFLOP/s")
    probed = probe_backends(args.device)
    print(f"attn_impl auto picks {resolve_attn_impl('auto', args.device)}; start-up probes:")
    for backend, why in probed.items():
        print(f"- {backend}: {'trains (forward + backward probe passed)' if why is None else why}")
    print(f"- torch_varlen's grouped KV heads: {varlen_gqa_mode()} (see varlen_gqa_mode)")
    print()
    agreement(cfg, present, min(args.seq_len, 2048), args.device)
    trainable = [name for name in auto_order(args.device) if probed[name] is None]  # auto's first

    with torch.device("meta"):  # count without allocating
        n_params = build_model(cfg).num_params()
    print(f"## Training step, {args.preset} ({n_params / 1e9:.2f}B params, {args.dispatch})")
    *batch, segments = packed_rows(cfg, args.batch, args.seq_len, args.device)
    print(
        f"{args.batch}x{args.seq_len} packed tokens, {TARGET_FRACTION:.0%} targets, bf16 autocast; "
        f"conversations of the real corpus' lengths: {len(segments)} segments, median "
        f"{segments.median():.0f} tokens, longest {segments.max()}"
    )
    print(f"AdamW, median of {args.steps} steps; spread: their interquartile range / median\n")
    print("| backend | mode | step ms | spread | tokens/s | MFU | compile s | peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    step_s: dict[tuple[str, bool], StepTime] = {}
    for label, backend, compiled, row_cfg, context in step_rows(cfg, trainable, args.dispatch):
        mode = "compiled" if compiled else "eager"
        if time.perf_counter() - began > args.budget_s:
            print(f"| {label} | {mode} | skipped: budget |")
            continue
        if args.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            with context():
                row, step_s[label, compiled] = throughput(
                    row_cfg, backend, compiled, args, peak, label, tuple(batch)
                )
            print(row, flush=True)
        except torch.OutOfMemoryError:
            print(f"| {label} | {mode} | OOM: lower --batch |")
        except Exception as error:  # the next configuration still runs
            print(f"| {label} | {mode} | error: {_first_line(error)} |", flush=True)
        torch._dynamo.reset()
    if trainable:
        print()
        if args.faster_backend_to:
            rows = {backend: backend for backend in trainable}
            choice = faster("attention backend", step_s, rows, trainable[0])
            args.faster_backend_to.write_text(choice + "\n")
        if args.faster_dispatch_to:
            rows = {args.dispatch: trainable[0], "grouped": f"{trainable[0]}, grouped dispatch"}
            choice = faster("morph dispatch", step_s, rows, args.dispatch)
            args.faster_dispatch_to.write_text(choice + "\n")


def faster(
    what: str, step_s: dict[tuple[str, bool], StepTime], rows: dict[str, str], default: str
) -> str:
    """The choice among ``rows`` (choice -> its table label) whose compiled step was fastest;
    ``default`` unless another beat it by more than run-to-run noise or it was not timed.
    Noise is NOISE or the larger of the two rows' measured spreads, whichever is wider.
    Said in a line under the table."""
    timed = {
        choice: step_s[label, True] for choice, label in rows.items() if (label, True) in step_s
    }
    choice = min(timed, key=lambda name: timed[name].median_s) if timed else default
    if default in timed:
        base, best = timed[default], timed[choice]
        noise = max(NOISE, base.spread, best.spread)
        if best.median_s > base.median_s * (1 - noise):
            choice = default
    steps = ", ".join(
        f"{name} {t.median_s * 1e3:.0f} ms (spread {t.spread:.1%})" for name, t in timed.items()
    )
    print(f"{what} for the trainer's run: {choice} (compiled step: {steps or 'none timed'})")
    return choice


class StepRow(NamedTuple):
    label: str
    backend: str
    compiled: bool
    cfg: ModelConfig
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def step_rows(cfg: ModelConfig, trainable: list[str], dispatch: str) -> list[StepRow]:
    """Each trainable backend eager and compiled; right after `auto`'s choice (the first), the
    variants under evaluation, compiled: grouped morph dispatch, and torch_varlen with its KV
    heads copied when it takes them unexpanded."""
    rows = [StepRow(b, b, compiled, cfg) for b in trainable for compiled in (False, True)]
    variants = []
    if trainable and cfg.n_morph_classes and dispatch != "grouped":
        grouped = dataclasses.replace(cfg, morph_dispatch="grouped")
        variants.append(StepRow(f"{trainable[0]}, grouped dispatch", trainable[0], True, grouped))
    if "torch_varlen" in trainable and varlen_gqa_mode() == "native":
        label = "torch_varlen, KV heads copied"
        variants.append(StepRow(label, "torch_varlen", True, cfg, kv_heads_copied))
    return rows[:2] + variants + rows[2:]


if __name__ == "__main__":
    main()
