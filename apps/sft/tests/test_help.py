"""Every command's --help describes every option, in plain text (no reST markup)."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from nedolm_sft.cli import COMMANDS, cli


def _command(name: str) -> click.Command:
    command = cli.get_command(click.Context(cli), name)
    assert command is not None, name
    return command


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_is_described(name: str) -> None:
    undescribed = [
        param.opts[0]
        for param in _command(name).params
        if isinstance(param, click.Option) and not param.hidden and not (param.help or "").strip()
    ]
    assert undescribed == [], f"nedolm-sft {name}: options without help: {undescribed}"


@pytest.mark.parametrize("name", ["", *sorted(COMMANDS)])
def test_help_is_plain_text(name: str) -> None:
    result = CliRunner().invoke(cli, [*name.split(), "--help"])
    assert result.exit_code == 0, result.output
    for markup in ("``", ":class:", ":func:", ".. "):
        assert markup not in result.output, f"nedolm-sft {name} --help shows {markup!r}"


def test_the_command_list_imports_no_command() -> None:
    """``nedolm-sft --help`` lists every command from the table alone: no torch, in a blink."""
    script = (
        "import sys; from nedolm_sft.cli import main; sys.argv = ['nedolm-sft', '--help']\n"
        "try: main()\n"
        "except SystemExit: pass\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('nedolm_sft.commands')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    *help_lines, imported = result.stdout.splitlines()
    assert imported == "[]", imported
    listed = [line.split()[0] for line in help_lines[help_lines.index("Commands:") + 1 :] if line]
    assert listed == sorted(COMMANDS)


def test_typical_session_starts_from_a_real_model_and_says_where_the_config_comes_from() -> None:
    text = CliRunner().invoke(cli, ["--help"]).output
    assert "nedolm-sft import-hf" in text
    assert "sft.yaml" in text and "examples/sft.yaml" in text


def test_prepare_format_help_separates_containers_from_the_sharegpt_schema() -> None:
    text = " ".join(CliRunner().invoke(cli, ["prepare", "--help"]).output.split())
    assert "Three containers: jsonl" in text
    assert "sharegpt is not a container: jsonl with every record forced to ShareGPT" in text


@pytest.mark.parametrize("name", ["generate", "chat"])
def test_generate_and_chat_take_placement_and_sampling_options(name: str) -> None:
    options = {opt for param in _command(name).params for opt in param.opts}
    wanted = {"--device", "--dtype", "--repetition-penalty", "--temperature", "--top-p"}
    assert wanted <= options
