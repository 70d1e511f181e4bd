"""``nedolm-sft demo``: the embedded default — a real end-to-end SFT on CPU in a few minutes.

It prepares the shipped sample of real Turkish chat data with the shipped tokenizer, writes a
random ``tiny`` base run, fine-tunes it with validation and checkpoints, plots the curves and
generates a reply: every stage a user runs on their own data, with the same code paths.
"""

from __future__ import annotations

import time
from importlib.resources import files
from pathlib import Path

import click
import yaml

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.format import read_special_tokens
from nedolm.data.tokenizer import load_tokenizer
from nedolm.model import morph_classes_from_vocab
from nedolm.train.base import init_base
from nedolm.train.config import load_sft_config
from nedolm.train.metrics import read_metrics, split_metrics
from nedolm.train.trainer import run as run_training
from nedolm_sft.chat_model import load_chat_model
from nedolm_sft.commands.plot import plot_run

DEFAULT_DIR = files("nedolm_sft") / "default"
SAMPLE = "tr_chat_sample.jsonl"
TOKENIZER = "tokenizer.json.gz"
SEQ_LEN = 512
SHARDS = 8
VALIDATION_SHARD = 7
DEMO_PROMPT = "Türkiye'nin başkenti neresidir?"


def sft_settings(out: Path, steps: int) -> dict:
    """The demo's SFT config: a CPU-sized recipe for a randomly initialised tiny model."""
    return {
        "run_dir": str(out / "run"),
        "base_config": str(out / "base" / "config.yaml"),
        "base_run_dir": str(out / "base"),
        "data_dir": str(out / "data"),
        "optim": {
            "lr": 2.0e-3,
            "min_lr_ratio": 0.1,
            "weight_decay": 0.01,
            "schedule": "cosine",
            "warmup_steps": max(1, steps // 10),
        },
        "train": {
            "seq_len": SEQ_LEN,
            "micro_batch_size": 8,
            "grad_accum_steps": 1,
            "max_steps": steps,
            "num_workers": 0,
            "compile": False,
            "log_interval": 5,
            "ckpt_interval": max(1, steps // 4),
            "keep_last": 2,
            "control_interval": 5,
            "archive_interval_hours": 0.0,
            "max_hours": 1.0,
        },
        "validation": {
            "shard_ids": [VALIDATION_SHARD],
            "interval": max(1, steps // 4),
            "batches": 4,
            "at_start": True,
        },
    }


def _stage(title: str) -> float:
    click.secho(f"\n== {title}", fg="cyan", bold=True)
    return time.monotonic()


@click.command()
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("nedolm-demo"),
    show_default=True,
    help="Where the corpus, base model, run and plot go.",
)
@click.option("--steps", type=click.IntRange(min=1), default=100, show_default=True)
def demo(out: Path, steps: int) -> None:
    """Run the embedded default: prepare → init-base → SFT → plot → generate, on CPU.

    Uses a shipped sample of real Turkish chat data (1,221 conversations) and tokenizer; nothing
    is downloaded. Re-running resumes or reuses what is already in OUT.

    \b
    Example:
      nedolm-sft demo --out nedolm-demo --steps 100
    """
    out = out.resolve()
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

    _stage(f"2/5 initialise a random `tiny` base model → {out / 'base'}")
    specials = read_special_tokens(data_dir)
    if not (out / "base" / "config.yaml").is_file():
        pieces = load_tokenizer(data_dir / specials.tokenizer.file).pieces()
        init_base(
            out / "base",
            preset_name="tiny",
            vocab_size=specials.vocab_size,
            eos_id=specials.eos_id,
            morph_classes=morph_classes_from_vocab(pieces),
        )
    config_path = out / "sft.yaml"
    config_path.write_text(yaml.safe_dump(sft_settings(out, steps), sort_keys=False))
    click.echo(f"SFT config: {config_path}")

    began = _stage(f"3/5 fine-tune for {steps} steps → {out / 'run'}")
    run_training(load_sft_config(config_path), compile=False)
    click.echo(f"training took {time.monotonic() - began:.0f}s")

    _stage("4/5 plot the curves")
    png = plot_run(out / "run", out / "run" / "curves.png")
    validation = _validation_losses(out / "run" / "metrics.jsonl")
    click.echo(f"{png}\nvalidation loss: {validation[0]:.3f} at the start → {validation[-1]:.3f}")

    _stage("5/5 generate a reply")
    chat = load_chat_model(out / "run")
    click.echo(f"kullanici> {DEMO_PROMPT}\nasistan> ", nl=False)
    reply = "".join(chat.reply([("user", DEMO_PROMPT)], max_new_tokens=32))
    click.echo(reply)

    click.secho("\nDone. Next:", bold=True)
    click.echo(
        f"  nedolm-sft stats {data_dir}\n"
        f"  nedolm-sft inspect {data_dir} --window 0\n"
        f"  nedolm-sft run {config_path}          # resumes; raise train.max_steps to go on\n"
        f"  nedolm-sft export {out / 'run'} --out {out / 'export'}\n"
        f"  nedolm-sft chat {out / 'run'}"
    )


def _validation_losses(metrics: Path) -> list[float]:
    _, validation = split_metrics(read_metrics(metrics.parent))
    return [r["val_loss"] for r in validation]
