"""The ``nedolm-sft`` click group. Each command lives in its own module under ``commands``.

Commands are imported only when invoked (``LazyGroup``): importing them all would import torch,
seconds before ``main`` could install the stop-signal handlers of ``run`` and ``launch``, and a
SIGTERM in those seconds would kill the job with no word of why.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import NamedTuple

import click

from nedolm.train.signals import install_early


class Command(NamedTuple):
    """Where a command lives (``module:attribute`` under ``nedolm_sft.commands``) and its line
    in ``nedolm-sft --help``, which lists commands without importing them (and torch)."""

    target: str
    summary: str


COMMANDS = {
    "plot": Command("plot:plot", "Plot a run's losses, learning rate and throughput."),
    "prepare": Command("data:prepare", "Build a verified corpus from chat files."),
    "verify": Command("data:verify", "Re-verify a corpus from its binary shards."),
    "stats": Command("data:stats", "Describe a corpus: counts, lengths, drops, packing."),
    "export": Command("export:export", "Export a run's newest checkpoint to Hugging Face."),
    "generate": Command("generate:generate", "Reply to one message with a run's checkpoint."),
    "chat": Command("generate:chat", "Chat with a run's newest checkpoint in the terminal."),
    "demo": Command("demo:demo", "Fine-tune the shipped base on a shipped sample (start here)."),
    "run": Command("train:run", "Fine-tune from an SFT YAML config; resumes from the run dir."),
    "init-base": Command("train:init_base_command", "Write a randomly initialised base run."),
    "import-hf": Command(
        "train:import_hf_command", "Make a base run of a Hugging Face Llama/Mistral."
    ),
    "inspect": Command("inspect:inspect", "Show a corpus's training windows, targets marked."),
    "launch": Command("launch:launch", "Run a config on every rank of a torchrun or SLURM job."),
}
STOPPABLE = ("run", "launch")
"""Commands that turn SIGTERM/SIGUSR1/SIGINT into a clean stop (``nedolm.train.signals``)."""


class LazyGroup(click.Group):
    """A group whose commands (``COMMANDS``) are imported when looked up, not when listed."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = COMMANDS.get(cmd_name)
        if command is None:
            return None
        module, _, attribute = command.target.partition(":")
        return getattr(importlib.import_module(f"nedolm_sft.commands.{module}"), attribute)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, COMMANDS[name].summary) for name in sorted(COMMANDS)])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="nedolm-sft", prog_name="nedolm-sft")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """NedoLM SFT: turn a pretrained NedoLM into a Turkish chat assistant.

    \b
    Typical session (your chat data, a Hugging Face Llama/Mistral model):
      nedolm-sft demo                  # first: everything below on a shipped sample
      nedolm-sft import-hf models/my-llama --out runs/base
      nedolm-sft prepare data/*.jsonl --tokenizer models/my-llama --seq-len 2048 --out corpus/
      nedolm-sft run sft.yaml --print-config   # check the resolved config, then run it
      nedolm-sft run sft.yaml
      nedolm-sft export runs/sft --out hf/
    \b
    sft.yaml: copy examples/sft.yaml of the repository (every key, documented) and set
    run_dir, base_config/base_run_dir (runs/base) and data_dir (corpus/); the demo writes
    a small working one into its --out directory.
    """
    ctx.obj = {"debug": debug}


def main() -> None:
    """Run the CLI; user mistakes end in one clear line, ``--debug`` shows the traceback."""
    if _command_name(sys.argv[1:]) in STOPPABLE:
        install_early()  # first: the imports below take seconds
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        if "--debug" in sys.argv[1:]:
            raise
        click.secho(f"error: {_message(exc)}", fg="red", err=True)
        click.echo("hint: run with `nedolm-sft --debug ...` for the full traceback", err=True)
        sys.exit(1)


def _message(exc: Exception) -> str:
    """The error in one line; a single process's RankError drops its "rank 0: Class:" frame,
    which only helps tell ranks apart."""
    from nedolm.dist import RankError  # torch is loaded by now: only commands raise these

    single = os.environ.get("WORLD_SIZE", "1") == "1"
    if isinstance(exc, RankError) and single and exc.__cause__ is not None:
        return f"{exc.action} failed: {exc.__cause__}"
    return str(exc)


def _command_name(args: list[str]) -> str | None:
    """The subcommand in ``args``: the first argument that is not a group option."""
    return next((arg for arg in args if not arg.startswith("-")), None)
