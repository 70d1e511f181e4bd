"""``nedolm-sft run`` (the SFT job), ``init-base`` (a random base run for demos) and ``import-hf``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import click
import yaml

from nedolm.data.format import read_special_tokens
from nedolm.data.tokenizer import TokenizerError, load_tokenizer
from nedolm.dist import watch_launcher
from nedolm.model import HFImportError, morph_classes_from_vocab, preset_names
from nedolm.train.base import import_hf_base, init_base
from nedolm.train.config import (
    ConfigError,
    SFTConfig,
    check_run_paths,
    dump_config,
    load_sft_config,
)
from nedolm.train.trainer import run as run_training


@click.command("run")
# No exists=True: the config loader names a missing or unreadable file, for run and launch alike.
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--smoke-steps",
    type=click.IntRange(min=1),
    default=None,
    help="Check a setup: run this many optimizer steps in the scratch dir RUN_DIR.smoke "
    "(emptied first); the run dir itself is not touched, so the real run starts cleanly.",
)
@click.option("--no-compile", is_flag=True, help="Run the model eagerly (no torch.compile).")
@click.option(
    "--set",
    "overrides",
    metavar="KEY.PATH=VALUE",
    multiple=True,
    help="Override a config key, e.g. --set optim.lr=1e-4 --set train.max_steps=50 "
    "(repeatable; the value is YAML, checked like a key in the file).",
)
@click.option(
    "--trust-unverified",
    is_flag=True,
    help="Resume from a checkpoint that carries no digest (no .sha256 sidecar and none inside "
    "it) instead of skipping it as unverifiable; same as --set train.trust_unverified=true.",
)
@click.option(
    "--print-config",
    is_flag=True,
    help="Print the resolved config (YAML with --set applied, every default filled in) and "
    "exit without touching the run dir.",
)
def run(
    config: Path,
    smoke_steps: int | None,
    no_compile: bool,
    overrides: tuple[str, ...],
    trust_unverified: bool,
    print_config: bool,
) -> None:
    """Fine-tune from the SFT YAML CONFIG; resumes from the run dir's latest checkpoint.

    Works alone (CPU or one GPU) and under torchrun or SLURM (one process per rank).
    SIGTERM/SIGUSR1 write a checkpoint and exit 0.

    \b
    Example:
      nedolm-sft run examples/sft.yaml --smoke-steps 20 --no-compile
      nedolm-sft run examples/sft.yaml --set optim.lr=1e-4 --print-config
      nedolm-sft launch --standalone --nproc-per-node 8 examples/sft.yaml
    """
    cfg = config_to_run(
        config, overrides, trust_unverified=trust_unverified, print_config=print_config
    )
    if cfg is not None:
        watch_launcher()  # under `launch`: its death stops this rank as a SIGTERM would
        run_training(cfg, smoke_steps=smoke_steps, compile=not no_compile)


def config_to_run(
    config: Path, overrides: Sequence[str], *, trust_unverified: bool, print_config: bool
) -> SFTConfig | None:
    """The config with ``--set`` (and ``--trust-unverified``) applied and its paths checked, or
    None once ``--print-config`` has printed it (nothing touched); a problem is a usage error
    (exit 2). For run and launch."""
    if trust_unverified:
        overrides = (*overrides, "train.trust_unverified=true")
    try:
        cfg = load_sft_config(config, overrides)
        if print_config:
            click.echo(dump_config(cfg), nl=False)
            return None
        check_run_paths(cfg)
    except (ConfigError, OSError) as exc:
        raise click.UsageError(str(exc)) from exc
    return cfg


def _parse_override(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> dict:
    overrides = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}")
        overrides[key] = yaml.safe_load(value)
    return overrides


@click.command("init-base")
@click.option(
    "--preset",
    "preset_name",
    type=click.Choice(preset_names()),
    required=True,
    help="Model size: tiny (CPU demos and tests) or nedolm-0.8b (the real model).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="The new base run dir (config.yaml + checkpoints/step-00000000.pt); must not exist.",
)
@click.option("--vocab-size", type=click.IntRange(min=1), default=None, help="Model vocabulary.")
@click.option(
    "--data-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Take vocab size, EOS id and morph classes from this prepared corpus (its tokenizer).",
)
@click.option(
    "--eos-id", type=click.IntRange(min=0), default=None, help="EOS id (with --vocab-size)."
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of the random initialisation."
)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    callback=_parse_override,
    help="Override a model config field, e.g. --set d_model=64 (repeatable).",
)
def init_base_command(
    preset_name: str,
    out: Path,
    vocab_size: int | None,
    data_dir: Path | None,
    eos_id: int | None,
    seed: int,
    overrides: dict,
) -> None:
    """Write a randomly initialised base run (config.yaml + checkpoint) of a model preset.

    \b
    Example:
      nedolm-sft init-base --preset tiny --data-dir corpus/ --out runs/base-tiny
      nedolm-sft init-base --preset tiny --vocab-size 32003 --eos-id 2 --out runs/base
    """
    if (vocab_size is None) == (data_dir is None):
        raise click.UsageError("give exactly one of --vocab-size or --data-dir")
    morph_classes = None
    if data_dir is not None:
        special = read_special_tokens(data_dir)
        vocab_size, eos_id = special.vocab_size, special.eos_id
        pieces = load_tokenizer(data_dir / special.tokenizer.file).pieces()
        morph_classes = morph_classes_from_vocab(pieces)
    if eos_id is None:
        raise click.UsageError("--vocab-size needs --eos-id (the tokenizer's EOS id)")
    path = init_base(
        out,
        preset_name=preset_name,
        vocab_size=vocab_size,
        eos_id=eos_id,
        seed=seed,
        morph_classes=morph_classes,
        overrides=overrides,
    )
    click.echo(f"wrote {out / 'config.yaml'} and {path}")


@click.command("import-hf")
@click.argument("hf_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="New base run dir.")
@click.option(
    "--morph-expert-dim",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Add morph experts of this width (zero output at first); 0 keeps the model dense.",
)
def import_hf_command(hf_dir: Path, out: Path, morph_expert_dim: int) -> None:
    """Write a base run from a Hugging Face Llama/Mistral directory HF_DIR.

    HF_DIR holds config.json, model.safetensors (or model.safetensors.index.json and its
    shards) and tokenizer.json; prepare the corpus with --tokenizer HF_DIR.

    \b
    Example:
      nedolm-sft import-hf models/TinyLlama --out runs/base-tinyllama
    """
    try:
        checkpoint = import_hf_base(hf_dir, out, morph_expert_dim=morph_expert_dim)
    except (HFImportError, TokenizerError, FileExistsError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"wrote {out / 'config.yaml'} and {checkpoint}")
