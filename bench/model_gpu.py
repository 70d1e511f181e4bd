"""CUDA benchmark of nedolm-model (run by bench/gpu.sh).

0. Each attention backend's start-up probe (forward + backward on tiny inputs) and what
   `attn_impl: auto` therefore picks on this device.
1. Backend agreement in bf16: every present attention backend (flash, torch_varlen, flex)
   against `sdpa` on the same packed rows: logits, fused-head loss and every gradient. Each
   backend runs on its own: one that fails prints its error row and the others still run.
2. Training-step tokens/s and MFU of a preset (default nedolm-0.8b) at seq_len 4096 on
   micro-batches made as the trainer makes them: conversations of the real corpus' shapes and
   lengths (bench/packing_lengths.json; the attention kernels' work depends on them) written as
   a corpus, packed by the product's planner, drawn by its loader and turned into inputs by its
   step; every row cycles through the same few, since one may hold a few long conversations and
   the next a hundred short ones. For each backend whose probe passed, eager and compiled (each
   block compiled on its own: one compiled graph serves all blocks, so compile takes seconds,
   not minutes; the longest segment traced as a symbol, as the trainer does); a failing
   configuration prints its error row. Right after `auto`'s backend come the variants under
   evaluation, compiled: `grouped` morph dispatch (grouped GEMMs, the FLOPs the MFU counts)
   against the preset's `masked`, and, when torch_varlen takes grouped KV heads unexpanded
   (torch 2.10/2.11 after its probe), torch_varlen with them copied per query head as before:
   each gain measured in the same run. Each row gives its median step and its spread
   (interquartile range / median over its timed passes);
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
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from nedolm.data import synthetic
from nedolm.data.format import read_special_tokens
from nedolm.data.loader import build_sft_loader
from nedolm.model import (
    ModelConfig,
    attention_backends,
    build_model,
    preset,
    probe_backends,
    resolve_attn_impl,
    varlen_gqa_mode,
)
from nedolm.model.attention import set_varlen_native_gqa
from nedolm.model.attn_select import auto_order
from nedolm.model.config import MORPH_DISPATCHES
from nedolm.train.compiling import trace_longest_segment_dynamically
from nedolm.train.flops import flops_per_token, peak_bf16_flops
from nedolm.train.step import MicroBatch, to_micro_batch

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


def product_micro_batches(
    batch: int, seq_len: int, device: str, count: int, seed: int = 0
) -> list[MicroBatch]:
    """``count`` micro-batches as the trainer gets them: conversations of the real corpus'
    shapes and lengths (``bench/packing_lengths.json``, random token ids) written as a corpus,
    planned by the product's packer, drawn by its loader and turned into model inputs by its
    step (``nedolm.train.step.to_micro_batch``).

    The packer fills windows best-fit decreasing, so one micro-batch may hold a few long
    conversations and the next a hundred short ones (the real corpus: ~86 per 4x4096 at the
    median, the longest from 157 to 4,096 tokens).
    """
    params = json.loads(LENGTHS_FILE.read_text(encoding="utf-8"))
    # Conversations average ~200 tokens: one per 16 tokens fills the micro-batches many times.
    n = max(256, count * batch * seq_len // 16)
    conversations = synthetic.sample_conversations(params, n, seed)
    with tempfile.TemporaryDirectory(prefix="nedolm-bench-") as corpus:
        synthetic.write_corpus(Path(corpus), [conversations], seed=seed)
        return loader_micro_batches(Path(corpus), seq_len, batch, device, count, seed)


def loader_micro_batches(
    corpus: Path,
    seq_len: int,
    batch: int,
    device: str,
    count: int,
    seed: int,
    shards: list | None = None,
) -> list[MicroBatch]:
    """The first ``count`` micro-batches of a prepared ``corpus`` as the trainer gets them: the
    packer's windows of ``shards`` (default: all) drawn by the loader (shuffled by ``seed``),
    turned into model inputs on ``device`` by ``to_micro_batch``."""
    loader, _ = build_sft_loader(corpus, seq_len, micro_batch_size=batch, seed=seed, shards=shards)
    eos = read_special_tokens(corpus).eos_id
    batches = iter(loader)
    return [to_micro_batch(next(batches), torch.device(device), eos) for _ in range(count)]


def model_inputs(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(input_ids, labels, packing layout keywords) of ``mb``, as the model takes them."""
    return mb.inputs, mb.labels, mb.layout()


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
    batch = model_inputs(product_micro_batches(2, seq_len, device, 1, seed=1)[0])
    ref_model = build(cfg, "sdpa", device)
    state = ref_model.state_dict()
    ref_loss, ref_grads, ref_logits = loss_grads_logits(ref_model, *batch, device)
    print(f"## a. Backend agreement vs sdpa, bf16 autocast, 2 layers, 2x{seq_len} packed tokens\n")
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
    micro: list[MicroBatch],
) -> tuple[str, StepTime]:
    """(the table row, the step's median and spread) of training on ``micro``, the
    micro-batches that every row shares: one untimed pass over them (compile, allocator), then
    ``args.rounds`` timed ones. A step's time is its round's mean; the spread is the rounds'."""
    model = build(cfg, backend, args.device)
    if compiled:
        trace_longest_segment_dynamically()  # as the trainer does: no recompile per batch
        model.compile_blocks()  # as the trainer does; not fullgraph: older flash-attn builds break
    fused = args.device == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)

    def step(mb: MicroBatch) -> None:
        input_ids, labels, layout = model_inputs(mb)
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss, _ = model(input_ids, labels, return_logits=False, loss_reduction="sum", **layout)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    start = time.perf_counter()
    step(micro[0])  # compile and allocator warm-up
    _sync(args.device)
    compile_s = time.perf_counter() - start if compiled else 0.0
    for mb in micro[1:]:
        step(mb)
    times = []
    for _ in range(args.rounds):
        _sync(args.device)
        start = time.perf_counter()
        for mb in micro:
            step(mb)
        _sync(args.device)
        times.append((time.perf_counter() - start) / len(micro))
    timed = StepTime.of(times)
    secs = timed.median_s
    tokens = micro[0].inputs.numel()
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="nedolm-0.8b")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4, help="distinct, every row")
    parser.add_argument("--rounds", type=int, default=3, help="timed passes over them")
    parser.add_argument("--dispatch", default="masked", choices=MORPH_DISPATCHES)
    parser.add_argument("--peak-tflops", type=float, default=None, help="bf16 dense peak")
    parser.add_argument("--budget-s", type=float, default=420, help="skip configs after this")
    parser.add_argument(
        "--faster-backend-to",
        type=Path,
        help="write here the trainable attention backend for the trainer's run (bench/gpu.sh "
        "hands it on): auto's, unless another's compiled step beat it beyond the noise",
    )
    parser.add_argument(
        "--faster-dispatch-to",
        type=Path,
        help="write here the morph dispatch for the trainer's run (bench/gpu.sh hands it on): "
        "--dispatch's, unless the other's compiled step beat it beyond the noise",
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
    print(f"## b. Training step, {args.preset} ({n_params / 1e9:.2f}B params, {args.dispatch})")
    micro = product_micro_batches(args.batch, args.seq_len, args.device, args.micro_batches)
    print(describe(micro))
    print(
        f"bf16 autocast, AdamW; step: the median of {args.rounds} timed passes over the "
        "micro-batches (each pass's mean); spread: their interquartile range / median\n"
    )
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
                    row_cfg, backend, compiled, args, peak, label, micro
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


def describe(micro: list[MicroBatch]) -> str:
    """What the rows train on, in two lines: the attention kernels' work depends on it."""
    segments = [mb.cu_seqlens.diff().tolist() for mb in micro]
    counts = sorted(len(lengths) for lengths in segments)
    lengths = torch.tensor([n for each in segments for n in each]).float()
    targets = sum(mb.targets for mb in micro) / sum(mb.inputs.numel() for mb in micro)
    batch, seq_len = micro[0].inputs.shape
    return (
        f"{len(micro)} micro-batches of {batch}x{seq_len} tokens as the trainer makes them "
        f"(conversations of the real corpus' shapes and lengths, the product's packer and "
        f"loader), {targets:.0%} targets:\nsegments per micro-batch {counts[0]}-{counts[-1]}, "
        f"median length {lengths.median():.0f} tokens, longest per micro-batch "
        f"{', '.join(str(mb.max_seqlen) for mb in micro)}"
    )


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
