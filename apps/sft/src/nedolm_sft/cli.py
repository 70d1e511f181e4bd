"""The ``nedolm-sft`` click group. Each command lives in its own module under ``commands``."""

from __future__ import annotations

import click

from nedolm_sft import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="nedolm-sft")
def cli() -> None:
    """NedoLM SFT: turn a pretrained NedoLM into a Turkish chat assistant.

    \b
    Typical session:
      nedolm-sft prepare data/*.jsonl --tokenizer tokenizer.json --out corpus/
      nedolm-sft run sft.yaml
    """


def main() -> None:
    cli()


# Command registration: each module under nedolm_sft.commands adds its commands here.
