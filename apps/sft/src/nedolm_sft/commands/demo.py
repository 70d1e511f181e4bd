"""``nedolm-sft demo``: the embedded default — a real end-to-end SFT on CPU in a few minutes.

It prepares the shipped sample of real Turkish chat data with the shipped tokenizer, fine-tunes
the shipped pretrained Turkish base model (``default/base``, made by
``tools/pretrain_demo_base.py``) with validation and checkpoints, plots the curves, and shows
what SFT did: held-out prompts answered by the base and by the fine-tuned model side by side,
the held-out assistant loss of both, and how many greedy replies close their message with
``<|mesaj_bitir|>``. Every stage is one a user runs on their own data, with the same code paths.
"""

from __future__ import annotations

import itertools
import json
import shutil
import time
from dataclasses import asdict, dataclass
from importlib.resources import files
from pathlib import Path

import click
import msgspec
import torch
import yaml

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.format import Shard
from nedolm.data.packing import plan_stored_shard
from nedolm.model import generate
from nedolm.train.base import BASE_CONFIG_FILE
from nedolm.train.config import dump_config, load_run_config, load_sft_config
from nedolm.train.metrics import read_metrics, split_metrics
from nedolm.train.trainer import run as run_training
from nedolm_sft.chat_model import ChatModel, load_base_chat_model, load_chat_model
from nedolm_sft.commands.plot import plot_run

DEFAULT_DIR = files("nedolm_sft") / "default"
SAMPLE = "tr_chat_sample.jsonl"
TOKENIZER = "tokenizer.json.gz"
BASE = "base"
HELDOUT_PROMPTS = "heldout_prompts.jsonl"
SEQ_LEN = 512
SHARDS = 8
VALIDATION_SHARD = 7
VALIDATION_PASSES = 6  # after the one at step 0: enough points to draw a validation curve
REPLY_TOKENS = 128  # a reply that has not closed its message by then counts as not closed
SHOWN_PROMPTS = 4  # prompts printed side by side; the figures use all of them
COMPARISON_FILE = "comparison.json"
PRETRAINING_FILE = "pretraining.json"
"""Beside the base weights: what pretraining gave it (tokens seen, held-out loss)."""


def sft_settings(steps: int, validation_windows: int) -> dict:
    """The demo's SFT config: a CPU-sized recipe fine-tuning the shipped pretrained base.

    Every path is relative to OUT, where the YAML is written beside its corpus, run and a copy
    of the base: the config keeps working after OUT (or the clone) moves, from any directory.
    Validation reads the whole validation shard once (one window per micro-batch), at the start
    and VALIDATION_PASSES times during the run, so its first pass is the base model's held-out
    assistant loss, its last the fine-tuned model's, and the plot draws the curve between.
    """
    return {
        "run_dir": "run",
        "base_config": f"{BASE}/config.yaml",
        "base_run_dir": BASE,
        "data_dir": "data",
        "optim": {
            "lr": 2.0e-3,
            "min_lr_ratio": 0.1,
            "weight_decay": 0.01,
            "schedule": "cosine",
            "warmup_steps": max(1, steps // 10),
        },
        "train": {
            "seq_len": SEQ_LEN,
            "micro_batch_size": 4,
            "grad_accum_steps": 1,
            "max_steps": steps,
            "num_workers": 0,
            "compile": False,
            "log_interval": 5,
            "ckpt_interval": max(1, steps // 2),
            "keep_last": 2,
            "control_interval": 5,
            "archive_interval_hours": 0.0,
            "max_hours": 1.0,
        },
        "validation": {
            "shard_ids": [VALIDATION_SHARD],
            "interval": max(1, steps // VALIDATION_PASSES),
            "batches": validation_windows,
            "micro_batch_size": 1,
            "num_workers": 0,
            "at_start": True,
        },
    }


@dataclass(frozen=True)
class Reply:
    text: str
    closed: bool
    """The model ended its message with ``<|mesaj_bitir|>`` within REPLY_TOKENS tokens."""


def greedy_reply(chat: ChatModel, prompt: str) -> Reply:
    """The greedy reply to one user message, up to its ``<|mesaj_bitir|>`` or REPLY_TOKENS."""
    ids: list[int] = []
    tokens = generate(
        chat.model,
        chat.render([("user", prompt)]),
        max_new_tokens=REPLY_TOKENS,
        stop_ids=(chat.specials.eos_id,),
    )
    for token in tokens:
        if token == chat.specials.message_end_id:
            return Reply(chat.tokenizer.decode(ids), closed=True)
        ids.append(token)
    return Reply(chat.tokenizer.decode(ids), closed=False)


def _stage(title: str) -> float:
    click.secho(f"\n== {title}", fg="cyan", bold=True)
    return time.monotonic()


@click.command()
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("nedolm-demo"),
    show_default=True,
    help="Where the corpus, run, plot and comparison go.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=150,
    show_default=True,
    help="SFT optimizer steps, each on 4 packed windows of 512 tokens.",
)
@click.option(
    "--prompts",
    type=click.IntRange(min=1, max=20),
    default=20,
    show_default=True,
    help="How many of the 20 shipped held-out prompts both models answer.",
)
def demo(out: Path, steps: int, prompts: int) -> None:
    """Run the embedded default: prepare → SFT of the shipped base → plot → base vs fine-tuned.

    Uses a shipped sample of real Turkish chat data (1,221 conversations), tokenizer and a small
    pretrained Turkish base model; nothing is downloaded. Re-running resumes or reuses what is
    already in OUT.

    \b
    Example:
      nedolm-sft demo --out nedolm-demo --steps 150
    """
    out = out.resolve()
    # A 5M-parameter model's matmuls are too small to gain from a second thread, and on a busy
    # machine threads wait for each other: decoding measured 8x slower with 2 than with 1.
    torch.set_num_threads(1)
    began = _stage(f"1/5 prepare the sample corpus → {out / 'data'}")
    data_dir = out / "data"
    report = build_corpus(
        [Path(str(DEFAULT_DIR / SAMPLE))],
        Path(str(DEFAULT_DIR / TOKENIZER)),
        data_dir,
        BuildOptions(seq_len=SEQ_LEN, shards=SHARDS, val_shards=(VALIDATION_SHARD,)),
        progress=True,
    )
    click.echo(
        f"{report.documents:,} conversations, {report.tokens:,} tokens in {report.shards} shards"
        f" (validation shard {VALIDATION_SHARD}) in {time.monotonic() - began:.1f}s"
    )

    base_dir = out / BASE
    _stage(f"2/5 the shipped pretrained Turkish base model → {base_dir}")
    _copy_base(base_dir)
    base = load_base_chat_model(base_dir, data_dir)
    pretraining = json.loads((base_dir / PRETRAINING_FILE).read_text(encoding="utf-8"))
    click.echo(
        f"{base.model.num_params():,} parameters, pretrained from scratch on CPU on plain Turkish "
        f"text only (no chat format): {pretraining['tokens_seen']:,} tokens seen, held-out "
        f"loss {pretraining['heldout_loss']:.2f} nats/token. A toy-sized model: expect the "
        f"chat format to be learned, not good answers. How it was made: {base_dir / 'RECIPE.md'}"
    )
    shard = Shard.in_dir(data_dir / "shards", VALIDATION_SHARD, SHARDS)
    windows = plan_stored_shard(shard, SEQ_LEN).plan.counts.windows
    config_path = out / "sft.yaml"
    config_path.write_text(yaml.safe_dump(sft_settings(steps, windows), sort_keys=False))
    click.echo(f"SFT config: {config_path} (paths relative to it; reusable from anywhere)")

    began = _stage(f"3/5 fine-tune for {steps} steps → {out / 'run'}")
    run_training(load_sft_config(config_path), compile=False)
    click.echo(f"training took {time.monotonic() - began:.0f}s")

    _stage("4/5 plot the curves")
    png = plot_run(out / "run", out / "run" / "curves.png")
    click.echo(str(png))

    _stage("5/5 what SFT did: the base and the fine-tuned model on held-out prompts")
    _compare(base, load_chat_model(out / "run"), out, prompts)

    click.secho("\nDone. Next:", bold=True)
    click.echo(
        f"  nedolm-sft stats {data_dir}\n"
        f"  nedolm-sft inspect {data_dir} --window 0\n"
        f"  nedolm-sft run {config_path} --set train.max_steps={2 * steps}   # train on\n"
        f"  nedolm-sft export {out / 'run'} --out {out / 'export'}\n"
        f"  nedolm-sft chat {out / 'run'}"
    )


def _copy_base(into: Path) -> None:
    """Copy the shipped base into OUT (once), so the demo's config names no installed path.

    The copy holds its tokenizer and names it relative to itself (the shipped base shares the
    tokenizer one level up): ``generate``, ``chat`` and ``export`` of OUT/base work on their own.
    """
    if (into / TOKENIZER).is_file():  # a copy made before it held its tokenizer is redone
        return
    tmp = into.with_name(into.name + ".tmp-copy")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(Path(str(DEFAULT_DIR / BASE)), tmp)
    config = load_run_config(tmp / BASE_CONFIG_FILE)
    (tmp / BASE_CONFIG_FILE).write_text(
        dump_config(msgspec.structs.replace(config, tokenizer=TOKENIZER))
    )
    shutil.copyfile(Path(str(DEFAULT_DIR / TOKENIZER)), tmp / TOKENIZER)
    shutil.rmtree(into, ignore_errors=True)
    tmp.rename(into)


def interleave_sources(records: list[dict]) -> list[dict]:
    """``records`` reordered round-robin over their sources (in order of first appearance), so
    that any prefix, the shown replies included, samples every source alike."""
    by_source: dict[str, list[dict]] = {}
    for record in records:
        by_source.setdefault(record["source"], []).append(record)
    rounds = itertools.zip_longest(*by_source.values())
    return [record for batch in rounds for record in batch if record is not None]


def _compare(base: ChatModel, tuned: ChatModel, out: Path, count: int) -> None:
    """Print replies side by side and the figures; write them all to OUT/comparison.json."""
    lines = (DEFAULT_DIR / HELDOUT_PROMPTS).read_text(encoding="utf-8").splitlines()
    prompts = interleave_sources([json.loads(line) for line in lines])[:count]
    rows = []
    for index, record in enumerate(prompts):
        before, after = greedy_reply(base, record["prompt"]), greedy_reply(tuned, record["prompt"])
        rows.append({**record, "base": asdict(before), "fine_tuned": asdict(after)})
        if index < SHOWN_PROMPTS:
            click.echo(f"\n[{record['source']}]")
            click.echo(f"kullanici>  {_one_line(record['prompt'])}")
            click.echo(f"base>       {_shown(before)}")
            click.echo(f"fine-tuned> {_shown(after)}")
    validation = _validation_losses(out / "run" / "metrics.jsonl")
    figures = {
        "heldout_assistant_loss": {"base": validation[0], "fine_tuned": validation[-1]},
        "closed_replies": {
            "base": sum(r["base"]["closed"] for r in rows),
            "fine_tuned": sum(r["fine_tuned"]["closed"] for r in rows),
            "prompts": len(rows),
            "max_new_tokens": REPLY_TOKENS,
        },
    }
    (out / COMPARISON_FILE).write_text(
        json.dumps({"figures": figures, "replies": rows}, ensure_ascii=False, indent=1) + "\n",
        encoding="utf-8",
    )
    loss, closed = figures["heldout_assistant_loss"], figures["closed_replies"]
    click.echo(
        f"\nheld-out assistant loss (validation shard {VALIDATION_SHARD}): "
        f"base {loss['base']:.3f} → fine-tuned {loss['fine_tuned']:.3f}\n"
        f"replies closed with <|mesaj_bitir|> within {REPLY_TOKENS} tokens (greedy, "
        f"{len(rows)} held-out prompts): base {closed['base']}/{len(rows)} → fine-tuned "
        f"{closed['fine_tuned']}/{len(rows)}\n"
        '("closed" measures the chat format, ending the reply where a message ends; it says '
        "nothing of the reply's quality)\n"
        f"every reply: {out / COMPARISON_FILE}"
    )


def _one_line(text: str, limit: int = 160) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _shown(reply: Reply) -> str:
    return _one_line(reply.text) + ("  ⏎" if reply.closed else f"  [not closed in {REPLY_TOKENS}]")


def _validation_losses(metrics: Path) -> list[float]:
    _, validation = split_metrics(read_metrics(metrics.parent))
    return [r["val_loss"] for r in validation]
