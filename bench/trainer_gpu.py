"""The product on a GPU, not only the model (run by bench/gpu.sh after bench/model_gpu.py).

    python bench/trainer_gpu.py [--smoke] [--data FILE ...] [--steps 10] [--grad-accum 4]
                                [--deadline-s 290] [--keep DIR]
                                [--launch-only] [--dispatch masked|sparse|grouped]
                                [--attn-impl auto|flash|torch_varlen|flex|sdpa]

c. `nedolm-sft run` on a prepared real corpus (the shipped Turkish chat sample and the glaive
   tool-call chats, plus any --data files) at seq_len 4096, nedolm-0.8b, compiled, 10 optimizer
   steps of 4 micro-batches of 4x4096 (the recipe of examples/sft-0.8b-8xh200.yaml; 2026-12-04's
   H200 run took one micro-batch per step: --grad-accum 1 --steps 30 repeats it):
   tokens/s and MFU from its metrics.jsonl, the first step after the compile warm-up, and the
   ratio to the model step alone: the same compiled model, the same real micro-batches already
   on the device, the same accumulation, no loader, collective or logging. A torch.profiler
   table of the top-15 CUDA kernels of those model steps, and where a step's time goes (wall,
   device busy, host waits, scalar reads) in them and in the trainer's own profile of 3 more
   steps of (c)'s run.
   Then the run saves one checkpoint (asynchronous, the default) and trains one more step
   while it is written: the training pause, the background write and that step's time, read
   from its metrics right after (c); and `nedolm-sft generate` answers from that checkpoint,
   timed as a user waits for it (last, after (e): issue 25's reply time is the one row a
   late run skips).
d. transformers' LlamaForCausalLM of the same dense shape (no morph experts), eager sdpa, bf16
   autocast, full-logits loss, the same micro-batches and accumulation: what an untuned TRL
   user runs.
e. `nedolm-sft launch --nproc-per-node 1` with ddp and with fsdp (NCCL on a GPU), a few eager
   steps each: the launcher, process group and wrappers work.

Every figure comes from this run on this machine; MFU is `nedolm.train.flops`'s one count.
`--smoke` runs every section on the CPU with a tiny model in under a minute (CI runs it), and says
which parts need CUDA. After (c), a section starts only if the time it is expected to take is left
before --deadline-s (counted from --started-at: bench/gpu.sh gives the time it starts the script
and kills it 10 s after the deadline), so a late section is skipped whole, not killed half-way,
and a short one still runs when a long one could not; a subprocess's timeout is the time left.
The last table says how long each section took beside the time it was expected to take.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import compile_trace  # bench/, beside this script
import torch
import yaml

from nedolm.model.config import ATTN_IMPLS, MORPH_DISPATCHES
from nedolm.train.metrics import read_metrics
from nedolm.train.profiling import ProfileSummary, summarize
from nedolm.train.testing import set_options, sft_paths

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "apps/sft/src/nedolm_sft/default"
FIXTURES = REPO / "packages/nedolm-data/tests/fixtures"
TOOL_CHATS = FIXTURES / "tool_chat/glaive_toolcall_en_demo.jsonl"


EXPECTED_S = {"model step": 35.0, "Llama": 30.0, "launch": 40.0, "generate": 20.0}
"""Seconds a section after (c) is expected to take on an H200, with a margin: a launch of (e)
took 33-35 s there (2026-12-04). The others were not timed apart, so these are estimates: that
day's loss_gpu.py and trainer_gpu.py took 244 s together, of which (c)'s compile warm-up 62 s
and (e) 68 s; the model step and (d) each build the 0.8B model and run 4-8 optimizer steps of 4
micro-batches at ~0.2 s (d: ~0.3 s) each (the model step compiles first); `generate` loads a
~3 GB checkpoint and writes 24 tokens."""


@dataclass(frozen=True)
class Deadline:
    """When the bench must be done: gpu.sh's hard timeout, less a margin."""

    seconds: float
    at: float
    """``time.monotonic()`` at the deadline."""

    def left(self) -> float:
        return max(self.at - time.monotonic(), 0.0)

    def used(self) -> float:
        """Seconds since the deadline started counting (beyond ``seconds`` when overrun)."""
        return time.monotonic() - (self.at - self.seconds)

    def too_late(self, expected_s: float) -> str | None:
        """Why a section of ``expected_s`` must not start now, or None."""
        left = self.left()
        if expected_s <= left:
            return None
        return f"~{expected_s:.0f} s expected, {left:.0f} s left of {self.seconds:.0f} s"

    @classmethod
    def counted_from(cls, seconds: float, started_at: float | None) -> Deadline:
        """``seconds`` after ``started_at`` (seconds since the epoch: when gpu.sh started this
        script, so its imports count too), or after now."""
        at = time.monotonic() + seconds
        if started_at is not None:
            at -= time.time() - started_at
        return cls(seconds, at)


class SectionTimes:
    """How long each section took, beside ``EXPECTED_S``: the figures a GPU run gives for
    correcting the estimates."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float | None, float | None]] = []

    @contextlib.contextmanager
    def timed(self, name: str, expected_s: float | None = None) -> Iterator[None]:
        """Time the block, a failed one too (its time is spent all the same)."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.rows.append((name, expected_s, time.monotonic() - started))

    def skipped(self, name: str, expected_s: float) -> None:
        self.rows.append((name, expected_s, None))

    def print_table(self, deadline: Deadline) -> None:
        print("## Section times (wall seconds, this run)\n")
        print("Expected: `EXPECTED_S`, the time left a section needs to start (e: each launch; "
              "its table gives each one's wall s); `-`: not gated.\n")  # fmt: skip
        print("| section | expected | took |\n|---|---:|---:|")
        for name, expected_s, took_s in self.rows:
            expected = "-" if expected_s is None else f"{expected_s:.0f}"
            took = "skipped" if took_s is None else f"{took_s:.1f}"
            print(f"| {name} | {expected} | {took} |")
        print(f"\n{deadline.used():.0f} s of the {deadline.seconds:.0f} s deadline used "
              "(imports included where --started-at was given)\n")  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """What one bench run trains: the GPU configuration, or the CPU smoke one."""

    device: str
    preset: str
    model_overrides: dict[str, int]
    seq_len: int
    micro_batch: int
    grad_accum: int
    """Micro-batches per optimizer step, in (c)'s run and in the steps it is compared with."""
    steps: int
    compile: bool
    launch_steps: int
    inputs: tuple[Path, ...]


def plan_for(args: argparse.Namespace) -> Plan:
    extra = tuple(Path(p) for p in args.data)
    if args.smoke:
        small = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128}
        small |= {"morph_expert_dim": 32, "max_seq_len": 128}
        chats = sorted(p for p in (FIXTURES / "tr_chat").glob("*.jsonl") if "alpaca" not in p.name)
        inputs = (*chats, *extra)
        return Plan("cpu", "tiny", small, 128, 2, 2, 3, False, 1, inputs)
    inputs = (DEFAULT_DATA / "tr_chat_sample.jsonl", TOOL_CHATS, *extra)
    return Plan("cuda", "nedolm-0.8b", {}, 4096, 4, args.grad_accum, args.steps, True, 5, inputs)


def sft(
    *args: str, timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``nedolm-sft ARGS`` in a subprocess (the checkout's sources, as gpu.sh exports them),
    with ``env`` added to this process's environment."""
    cmd = [sys.executable, "-m", "nedolm_sft", *args]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise RuntimeError(f"nedolm-sft {args[0]} exited {proc.returncode}:\n{tail}")
    return proc


def prepare(plan: Plan, root: Path) -> tuple[Path, Path]:
    """A prepared corpus and a random base run of the plan's preset for it."""
    tokenizer = root / "tokenizer.json"
    tokenizer.write_bytes(gzip.decompress((DEFAULT_DATA / "tokenizer.json.gz").read_bytes()))
    corpus, base = root / "corpus", root / "base"
    inputs = [str(p) for p in plan.inputs]
    sft("prepare", *inputs, "--tokenizer", str(tokenizer), "--out", str(corpus),
        "--seq-len", str(plan.seq_len), "--shards", "4", "--val-shards", "3",
        "--unsupported-roles", "drop", "--on-bad-record", "drop", "--no-progress", timeout=300)  # fmt: skip
    sets = set_options(plan.model_overrides)
    sft("init-base", "--preset", plan.preset, "--data-dir", str(corpus), "--out", str(base),
        *sets, timeout=300)  # fmt: skip
    return corpus, base


def write_config(
    path: Path,
    plan: Plan,
    corpus: Path,
    base: Path,
    profile: dict[str, int] | None = None,
    **train: object,
) -> Path:
    doc = {
        **sft_paths(path.with_suffix(""), base, corpus),
        "optim": {"lr": 1e-5, "warmup_steps": 2},
        "train": {
            "seq_len": plan.seq_len,
            "micro_batch_size": plan.micro_batch,
            "grad_accum_steps": plan.grad_accum,
            "max_steps": plan.steps,
            "num_workers": 2 if plan.device == "cuda" else 0,
            "compile": plan.compile,
            "log_interval": 1,
            "ckpt_interval": 100_000,
            "save_final_checkpoint": False,
            "archive_interval_hours": 0.0,
            **train,
        },
        "validation": {"enabled": False},
        "profile": profile or {},
    }
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


RUN_LOG_KEYS = ("schedule:", "attn_impl", "recompil", "graph break", "compile cache")
"""(c)'s log lines printed under its heading: the recipe the trainer ran, its attention backend,
compile events."""
PROFILED_STEPS = 3
GENERATE_PROMPT = "Türkiye'nin başkenti neresidir?"
GENERATE_TOKENS = 24


def profiled(plan: Plan) -> dict:
    """(c)'s run goes on past the measured steps: PROFILED_STEPS in its profile window (the
    trainer's own ``profile.start_step``), then one step that saves a checkpoint and one that
    trains while it is written. Those steps run slower and are not timed."""
    window = {"start_step": plan.steps + 1, "steps": PROFILED_STEPS}
    checkpoint_step = plan.steps + PROFILED_STEPS + 1
    return {"profile": window, "ckpt_interval": checkpoint_step, "max_steps": checkpoint_step + 1}


def step_records(records: list[dict]) -> list[dict]:
    """The training-step records among a run's metrics (``read_metrics``, the trainer's own
    reader)."""
    return [r for r in records if "tokens_per_s" in r]


def measured_steps(plan: Plan, steps: list[dict]) -> tuple[list[dict], list[dict]]:
    """Of the run's step records, (c)'s timed ones (the first ``plan.steps``) and their steady
    part, the last 2/3."""
    records = [r for r in steps if r["step"] <= plan.steps]
    return records, records[len(records) // 3 :] or records


def trainer_section(plan: Plan, config: Path, keep: Path | None) -> float:
    """(c): the real run; returns its steady tokens/s. ``keep`` gets its log, metrics and
    profile."""
    started = time.monotonic()
    trace = config.with_suffix("") / "compile_trace"  # compile_trace.py's input
    try:
        sft("run", str(config), timeout=420, env={"TORCH_TRACE": str(trace)})
    finally:
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for name in ("train.log", "metrics.jsonl"):
                if (config.with_suffix("") / name).exists():
                    shutil.copy(config.with_suffix("") / name, keep / name)
            # The profile window's files (the trace opens in Perfetto), flat: a device
            # machine's $OUT returns files at most two folders down.
            for path in sorted((config.with_suffix("") / "profile").glob("*/rank0.*")):
                shutil.copy(path, keep / f"profile-{path.name}")
    wall = time.monotonic() - started
    records, steady = measured_steps(plan, step_records(read_metrics(config.with_suffix(""))))
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in steady)
    mfu = [r["mfu"] for r in steady if "mfu" in r]
    log = (config.with_suffix("") / "train.log").read_text(encoding="utf-8")
    warmup = next(
        (line.split("] INFO ")[-1] for line in log.splitlines() if "warm-up done" in line),
        "no compile",
    )
    print(f"## c. `nedolm-sft run`, {plan.preset}, {plan.micro_batch}x{plan.seq_len}, "
          f"{plan.grad_accum} micro-batches per step, real corpus\n")  # fmt: skip
    print(f"{len(records)} steps, wall {wall:.0f} s with start-up; compile: {warmup}\n")
    for line in log.splitlines():
        if any(key in line for key in RUN_LOG_KEYS):
            print(f"    {line.split('] ')[-1]}")
    print(f"\n### c. compile time by phase (TORCH_TRACE)\n\n{compile_trace.summary(trace)}\n")
    after_first = statistics.median(r["tokens_per_s"] for r in records[1:] or records)
    print("| first step s | steady step s | tokens/s (median, last 2/3) "
          "| tokens/s (median, all but the first) | MFU |")  # fmt: skip
    print("|---|---|---|---|---|")
    mfu_text = f"{statistics.median(mfu):.1%}" if mfu else "n/a (no CUDA peak)"
    print(f"| {records[0]['sec_per_step']:.2f} | {statistics.median(r['sec_per_step'] for r in steady):.3f} "
          f"| {tokens_per_s:,.0f} | {after_first:,.0f} | {mfu_text} |\n")  # fmt: skip
    return tokens_per_s


def checkpoint_section(plan: Plan, run_dir: Path) -> None:
    """(c, continued): the run's one checkpoint, from its metrics.jsonl (issue 25's target on
    nedolm-0.8b: training pause <= 2 s). Costs no device time, so it comes right after (c)."""
    from nedolm.train.checkpoint import CHECKPOINT_DIR

    save, steps = checkpoint_and_steps(run_dir)
    steady = statistics.median(r["sec_per_step"] for r in measured_steps(plan, steps)[1])
    during = next((r["sec_per_step"] for r in steps if r["step"] == save["step"] + 1), None)
    files = (run_dir / CHECKPOINT_DIR).rglob("*")
    size = sum(path.stat().st_size for path in files if path.is_file())
    mode = "in the background" if save["background"] else "synchronous"
    print(f"### c. checkpoint at step {save['step']} ({size / 2**30:.2f} GiB, {mode})\n")
    print("| training pause s | write s | step trained during the write s | steady step s |")
    print("|---|---|---|---|")
    during_text = f"{during:.3f}" if during is not None else "n/a"
    print(f"| {save['pause_s']:.2f} | {save['write_s']:.2f} | {during_text} | {steady:.3f} |\n")


def generate_section(run_dir: Path, deadline: Deadline) -> None:
    """(c, last): `nedolm-sft generate` from the run's checkpoint, timed from process start to
    reply as a user waits for it (issue 25's target on nedolm-0.8b: <= 10 s). Last of all, so a
    late run costs this row, not (e)."""
    save, _ = checkpoint_and_steps(run_dir)
    started = time.monotonic()
    reply = sft("generate", str(run_dir), "--prompt", GENERATE_PROMPT,
                "--max-new-tokens", str(GENERATE_TOKENS), timeout=deadline.left()).stdout  # fmt: skip
    generate_s = time.monotonic() - started
    print(f"### c. `nedolm-sft generate` from the step {save['step']} checkpoint "
          f"({GENERATE_TOKENS} new tokens at most)\n")  # fmt: skip
    print("| generate s, process start to reply |")
    print("|---|")
    print(f"| {generate_s:.1f} |\n")
    print(f"reply: {' '.join(reply.split())[:200]}\n")


def checkpoint_and_steps(run_dir: Path) -> tuple[dict, list[dict]]:
    """The newest checkpoint record of the run's metrics.jsonl, and its step records."""
    metrics = read_metrics(run_dir)
    saves = [r for r in metrics if r.get("kind") == "checkpoint"]
    if not saves:
        raise RuntimeError(f"{run_dir / 'metrics.jsonl'} has no checkpoint record")
    return saves[-1], step_records(metrics)


def guarded_trainer_section(
    plan: Plan, config: Path, args: argparse.Namespace, corpus: Path, base: Path
) -> tuple[float, Path, bool]:
    """(c), and when it fails with a --dispatch or --attn-impl, (c) again with the base's
    settings: (tokens/s or 0.0, the config that ran, whether anything failed)."""
    try:
        return trainer_section(plan, config, args.keep), config, False
    except (RuntimeError, subprocess.TimeoutExpired):
        print("## c. `nedolm-sft run` FAILED\n")
        print_traceback()
        if not (args.dispatch or args.attn_impl):
            return 0.0, config, True
    print("(c) again with the base's morph dispatch and attention backend:\n")
    fallback = write_config(
        config.with_name("run-base-settings.yaml"), plan, corpus, base, **profiled(plan)
    )
    try:
        return trainer_section(plan, fallback, args.keep), fallback, True
    except (RuntimeError, subprocess.TimeoutExpired):
        print_traceback()
        return 0.0, config, True


def print_traceback() -> None:
    """The exception being handled, its last 4,000 characters as a code block of the tables."""
    print("```\n" + traceback.format_exc()[-4000:] + "```\n")


def run_model_config(config: Path):
    """The model config the run of ``config`` trains."""
    from nedolm.train.base import base_run_config, model_config
    from nedolm.train.config import load_sft_config

    sft = load_sft_config(config)
    t = sft.train
    return model_config(
        base_run_config(sft), morph_dispatch=t.morph_dispatch, attn_impl=t.attn_impl
    )


def run_precision(plan: Plan, config: Path) -> str:
    """The precision the run of ``config`` computes in on ``plan.device`` (``auto`` resolved)."""
    from nedolm.train.config import load_sft_config
    from nedolm.train.precision import resolve_precision

    return resolve_precision(load_sft_config(config).train.precision, torch.device(plan.device))


def real_optimizer_steps(plan: Plan, config: Path, count: int):
    """The first ``count`` optimizer steps of the run of ``config`` (``plan.grad_accum``
    micro-batches each, on the device): its training shards drawn with its seed, the very
    micro-batches its trainer starts with; and the corpus' EOS id."""
    from model_gpu import loader_micro_batches  # bench/, beside this script (as (b) makes them)

    from nedolm.data.contract import SHARD_MANIFEST_FILE, read_contract
    from nedolm.data.format import read_special_tokens
    from nedolm.data.packing import discover_sft_shards
    from nedolm.train.config import load_sft_config
    from nedolm.train.setup import split_corpus

    run = load_sft_config(config)
    held_out = read_contract(run.data_dir)[SHARD_MANIFEST_FILE]["validation_shard_ids"]
    train, _ = split_corpus(run, discover_sft_shards(run.data_dir, plan.seq_len), held_out)
    n = plan.grad_accum
    micro = loader_micro_batches(
        run.data_dir, plan.seq_len, plan.micro_batch, plan.device, count * n, run.train.seed, train
    )
    steps = [micro[i : i + n] for i in range(0, len(micro), n)]
    return steps, read_special_tokens(run.data_dir).eos_id


def model_step_section(plan: Plan, config: Path, trainer_tps: float) -> None:
    """(c, continued): the model step alone on the same real batches, and its kernels."""
    from nedolm.dist import DistInfo
    from nedolm.model import build_model, resolve_attn_impl
    from nedolm.train.compiling import compile_and_warm_up
    from nedolm.train.precision import COMPUTE_DTYPES
    from nedolm.train.step import LossOptions, StepSettings, forward_backward

    model_cfg = run_model_config(config)
    compute = run_precision(plan, config)
    # as the run does: probed in its compute dtype before compiling
    resolve_attn_impl(model_cfg.attn_impl, plan.device, COMPUTE_DTYPES[compute])
    torch.manual_seed(0)
    with torch.device(plan.device):
        model = build_model(model_cfg)
    steps, eos = real_optimizer_steps(plan, config, 5)
    settings = StepSettings(
        DistInfo(0, 1, 0, torch.device(plan.device)),
        eos,
        grad_accum_steps=plan.grad_accum,
        grad_clip=1.0,
        loss=LossOptions(
            assistant_only_head=True, loss_fp32_logits=True, use_amp=compute == "bf16"
        ),
    )
    if plan.compile:
        compile_and_warm_up(model, settings, plan.micro_batch, plan.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step(micro) -> None:
        scale = 1.0 / sum(mb.targets for mb in micro)  # the trainer's, on one rank
        for mb in micro:
            forward_backward(model, mb, settings.loss, scale)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model_tps = median_tokens_per_s(plan, step, steps)
    print("### c. trainer vs the model step alone (same model, same real micro-batches)\n")
    print("| trainer tokens/s | model step tokens/s | trainer / model step |")
    print("|---|---|---|")
    print(f"| {trainer_tps:,.0f} | {model_tps:,.0f} | {trainer_tps / model_tps:.2f} |\n")
    profile_table(plan, config, step, steps[1:4])


def median_tokens_per_s(plan: Plan, step, steps) -> float:
    """Tokens/s of ``step`` over ``steps[1:]`` (median), after one untimed warm-up step; each
    of ``steps`` is an optimizer step's micro-batches."""
    step(steps[0])
    times = []
    for micro in steps[1:]:
        _sync(plan.device)
        started = time.perf_counter()
        step(micro)
        _sync(plan.device)
        times.append(time.perf_counter() - started)
    return sum(mb.inputs.numel() for mb in steps[0]) / statistics.median(times)


def profile_table(plan: Plan, config: Path, step, steps) -> None:
    """The top-15 kernels (CPU ops on a CPU) of model steps, and where a step's time goes in
    them and in the trainer's own profile window of (c)'s run (same per-step summary)."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = plan.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities, acc_events=True) as prof:  # as the trainer's window
        started = time.perf_counter()
        for micro in steps:
            step(micro)
        _sync(plan.device)
        wall_s = time.perf_counter() - started
    what = (
        "CUDA kernels" if on_cuda else "CPU ops (no CUDA device: the CUDA kernel table needs one)"
    )
    print(f"### c. torch.profiler: top-15 {what} of {len(steps)} model steps\n")
    sort = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    print("```")
    print(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60))
    print("```\n")
    rows = [
        (f"model step alone, {len(steps)} steps", summarize(prof.events(), 1, len(steps), wall_s))
    ]
    first, last = plan.steps + 1, plan.steps + PROFILED_STEPS
    window = config.with_suffix("") / f"profile/steps-{first}-{last}/rank0.summary.json"
    if window.exists():  # (c) ran: the trainer's own profile of its steps
        rows.insert(0, (f"trainer, steps {first}-{last}", ProfileSummary(**_fields(window))))
    print("### c. where a step's time goes (per step, under the profiler)\n")
    print("| what | wall ms | device busy ms | busy / wall | device ops | host waits ms "
          "| scalar reads |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, summary in rows:
        if summary.device_busy_ms is None:
            device = "n/a (CPU) | | |"
        else:
            device = (f"{summary.device_busy_ms:.1f} | {summary.device_busy_ms / summary.wall_ms:.0%} "
                      f"| {summary.device_ops:.0f} | {summary.host_wait_ms:.1f}")  # fmt: skip
        print(f"| {name} | {summary.wall_ms:.1f} | {device} | {summary.scalar_reads:.1f} |")
    print()


def _fields(summary_json: Path) -> dict:
    """A ``rankR.summary.json``'s ProfileSummary fields (the file adds the rank)."""
    fields = json.loads(summary_json.read_text(encoding="utf-8"))
    return {key: fields[key] for key in ProfileSummary.__dataclass_fields__}


def llama_section(plan: Plan, config: Path, trainer_tps: float) -> None:
    """(d): transformers' Llama of the same dense shape on the same tokens per step."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        print(f"## d. transformers LlamaForCausalLM: skipped: {exc}\n")
        return
    from nedolm.model import hf_config_fields

    fields = hf_config_fields(run_model_config(config))  # the export's mapping, experts left out
    llama_config = LlamaConfig(**fields, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(plan.device):
        model = LlamaForCausalLM(llama_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    steps, _ = real_optimizer_steps(plan, config, 4)
    use_amp = run_precision(plan, config) == "bf16"  # as the trainer computes

    def step(micro) -> None:
        for mb in micro:
            with torch.autocast(plan.device, dtype=torch.bfloat16, enabled=use_amp):
                loss = model(input_ids=mb.inputs, labels=mb.inputs).loss  # full logits, all tokens
            (loss / len(micro)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    llama_tps = median_tokens_per_s(plan, step, steps)
    print("## d. transformers LlamaForCausalLM, same dense shape, eager sdpa, no packing mask\n")
    print("| nedolm trainer tokens/s | Llama tokens/s | trainer / Llama |")
    print("|---|---|---|")
    print(f"| {trainer_tps:,.0f} | {llama_tps:,.0f} | {trainer_tps / llama_tps:.2f} |\n")


def launch_section(plan: Plan, corpus: Path, base: Path, root: Path, deadline: Deadline) -> None:
    """(e): the launcher with each parallelism (ddp first), a few eager steps; a launch the
    deadline leaves no time for is skipped."""
    backend = "NCCL" if plan.device == "cuda" else "gloo (CPU)"
    print(f"## e. `nedolm-sft launch --nproc-per-node 1`, {backend}, {plan.launch_steps} steps\n")
    print("| parallelism | result | tokens/s (last step) | wall s |")
    print("|---|---|---|---|")
    failures: list[str] = []
    for parallelism in ("ddp", "fsdp"):
        if late := deadline.too_late(EXPECTED_S["launch"]):
            print(f"| {parallelism} | skipped: {late} | | |")
            continue
        config = write_config(
            root / f"launch-{parallelism}.yaml",
            plan,
            corpus,
            base,
            parallelism=parallelism,
            max_steps=plan.launch_steps,
            grad_accum_steps=1,  # (e) checks that a launch trains; (c) measures the recipe
            compile=False,
        )
        started = time.monotonic()
        try:
            sft("launch", "--standalone", "--nproc-per-node", "1", str(config),
                timeout=deadline.left())  # fmt: skip
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            reason = str(exc).strip().splitlines()[-1][:200]
            print(f"| {parallelism} | FAILED: {reason} | | {time.monotonic() - started:.0f} |")
            failures.append(f"{parallelism}:\n{exc}")
            continue
        records = step_records(read_metrics(config.with_suffix("")))
        print(f"| {parallelism} | ok, {len(records)} steps | {records[-1]['tokens_per_s']:,.0f} "
              f"| {time.monotonic() - started:.0f} |")  # fmt: skip
    print()
    for failure in failures:  # the cause, for whoever reads the table next
        print(f"```\n{failure}\n```\n")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, few steps")
    parser.add_argument("--data", nargs="*", default=[], help="more chat files for the corpus")
    parser.add_argument("--steps", type=int, default=10, help="(c)'s measured optimizer steps")
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=4,
        help="micro-batches per optimizer step (default: examples/sft-0.8b-8xh200.yaml's)",
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=290,
        help="finish by then: no section starts that is expected to end later (gpu.sh: 290)",
    )
    parser.add_argument(
        "--started-at",
        type=float,
        help="seconds since the epoch the deadline counts from (gpu.sh: when it started this "
        "script; default: the end of its imports)",
    )
    parser.add_argument(
        "--keep", type=Path, help="copy (c)'s train.log, metrics and profile files here"
    )
    parser.add_argument(
        "--launch-only", action="store_true", help="only (e): a short check of the launcher"
    )
    parser.add_argument(
        "--dispatch",
        choices=MORPH_DISPATCHES,
        help="train.morph_dispatch of (c) (default: the preset's)",
    )
    parser.add_argument(
        "--attn-impl",
        choices=ATTN_IMPLS,
        help="train.attn_impl of (c) (default: the base's, auto)",
    )
    args = parser.parse_args()
    plan = plan_for(args)
    if plan.device == "cuda" and not torch.cuda.is_available():
        sys.exit("torch sees no CUDA device (use --smoke for the CPU check)")
    deadline = Deadline.counted_from(args.deadline_s, args.started_at)
    times = SectionTimes()
    with tempfile.TemporaryDirectory(prefix="nedolm-bench-") as tmp:
        root = Path(tmp)
        with times.timed("prepare the corpus and the base"):
            corpus, base = prepare(plan, root)
        dispatch_text = args.dispatch or "the preset's"
        print(
            f"# The product: {plan.preset} on {plan.device}, {len(plan.inputs)} input files, "
            f"attn_impl {args.attn_impl or 'auto'}, {dispatch_text} morph dispatch\n"
        )
        chosen = {"morph_dispatch": args.dispatch, "attn_impl": args.attn_impl}
        chosen = {key: value for key, value in chosen.items() if value}
        config = write_config(root / "run.yaml", plan, corpus, base, **profiled(plan), **chosen)
        trainer_tps, failed = 0.0, False
        if not args.launch_only:
            with times.timed("c. `nedolm-sft run`"):
                trainer_tps, config, failed = guarded_trainer_section(
                    plan, config, args, corpus, base
                )
        # The checkpoint's figures (read from the run's metrics: free) at once; issue 24's
        # tables next; `generate` (issue 25's) last, so a slow disk or compile on the device
        # costs that row, not (e), when time runs short.
        launch = (
            "e. launch",
            EXPECTED_S["launch"],
            functools.partial(launch_section, plan, corpus, base, root, deadline),
        )
        run_dir = config.with_suffix("")
        sections = (
            ("c. checkpoint", 0.0, lambda: checkpoint_section(plan, run_dir)),
            ("c. model step", EXPECTED_S["model step"],
             lambda: model_step_section(plan, config, trainer_tps)),
            ("d. Llama", EXPECTED_S["Llama"], lambda: llama_section(plan, config, trainer_tps)),
            launch,
            ("c. generate", EXPECTED_S["generate"], lambda: generate_section(run_dir, deadline)),
        )  # fmt: skip
        for name, expected_s, section in (launch,) if args.launch_only else sections:
            if late := deadline.too_late(expected_s):
                print(f"({name} skipped: {late})\n")
                times.skipped(name, expected_s)
                continue
            try:
                with times.timed(name, expected_s):
                    section()
            except Exception:  # one section's failure must not cost the GPU run the others
                print_traceback()
                failed = True
            sys.stdout.flush()
            torch._dynamo.reset()  # its caches hold the compiled model and its weights
            gc.collect()  # and cycles may hold the rest: the launches below need the memory
            if plan.device == "cuda":
                torch.cuda.empty_cache()
                print(f"(bench process: {torch.cuda.memory_reserved() / 2**30:.1f} GiB of GPU "
                      "memory still reserved)\n")  # fmt: skip
    times.print_table(deadline)
    if failed:
        sys.exit("a section failed: its traceback is above")


if __name__ == "__main__":
    main()
