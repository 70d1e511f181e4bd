"""The ``nedolm-sft`` click group. Each command lives in its own module under ``commands``."""

from __future__ import annotations

import sys

import click

from nedolm_sft import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="nedolm-sft")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """NedoLM SFT: turn a pretrained NedoLM into a Turkish chat assistant.

    \b
    Typical session:
      nedolm-sft demo                      # everything below on a shipped sample
      nedolm-sft prepare data/*.jsonl --tokenizer tokenizer.json --seq-len 2048 --out corpus/
      nedolm-sft init-base --preset tiny --data-dir corpus/ --out base/
      nedolm-sft run sft.yaml
      nedolm-sft export runs/sft --out hf/
    """
    ctx.obj = {"debug": debug}


def main() -> None:
    """Run the CLI; user mistakes end in one clear line, ``--debug`` shows the traceback."""
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
        click.secho(f"error: {exc}", fg="red", err=True)
        click.echo("hint: run with `nedolm-sft --debug ...` for the full traceback", err=True)
        sys.exit(1)


# Command registration: each module under nedolm_sft.commands adds its commands here.
from nedolm_sft.commands.plot import plot  # noqa: E402

cli.add_command(plot)
from nedolm_sft.commands.data import prepare, stats, verify  # noqa: E402

cli.add_command(prepare)
cli.add_command(verify)
cli.add_command(stats)
from nedolm_sft.commands.export import export  # noqa: E402
from nedolm_sft.commands.generate import chat, generate  # noqa: E402

cli.add_command(export)
cli.add_command(generate)
cli.add_command(chat)
from nedolm_sft.commands.demo import demo  # noqa: E402

cli.add_command(demo)

from nedolm_sft.commands.train import import_hf_command, init_base_command, run  # noqa: E402

cli.add_command(run)
cli.add_command(init_base_command)
cli.add_command(import_hf_command)
from nedolm_sft.commands.inspect import inspect  # noqa: E402

cli.add_command(inspect)
from nedolm_sft.commands.launch import launch  # noqa: E402

cli.add_command(launch)
