"""``nedolm-sft inspect`` without colour (piped output, ``NO_COLOR``): targets stay visible as
``[[...]]``; on a terminal they are bold green and unmarked."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.inspect import corpus_decoder
from nedolm_sft.cli import cli

FIXTURES = Path(__file__).resolve().parents[3] / "packages" / "nedolm-data" / "tests" / "fixtures"
TOKENIZER = FIXTURES / "tokenizer" / "mistral_v1.tokenizer.json.gz"
ANSI = "\x1b["
MARKED = re.compile(r"\[\[(.*?)\]\]", re.DOTALL)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Turkish Q/A and English tool-calling chats: targets, context and tool-call lines."""
    out = tmp_path_factory.mktemp("plain") / "corpus"
    inputs = [
        FIXTURES / "tr_chat" / "arc_tr.jsonl",
        FIXTURES / "tool_chat" / "glaive_toolcall_en_demo.jsonl",
    ]
    build_corpus(inputs, TOKENIZER, out, BuildOptions(seq_len=512, shards=2, val_fraction=0))
    return out


def target_text(corpus: Path, window: int) -> str:
    """What the window trains, decoded run by run as the renderer does, newlines left out."""
    view = json.loads(
        CliRunner().invoke(cli, ["inspect", str(corpus), "--window", str(window), "--json"]).output
    )
    decode = corpus_decoder(corpus)
    runs = [r for p in view["pieces"] for r in p["runs"] if r["target"]]
    assert runs
    text = "".join("⟨/⟩" if r["part"] == "end" else decode(r["token_ids"]) for r in runs)
    return text.replace("\n", "")


def marked_text(output: str) -> str:
    return "".join(MARKED.findall(output)).replace("\n", "").replace("⚙ ", "")


@pytest.mark.parametrize("env", [{}, {"NO_COLOR": "1"}], ids=["piped", "NO_COLOR"])
def test_without_colour_every_target_is_marked(corpus, env):
    """Piped (CliRunner's output is no terminal), or with colour forced but NO_COLOR set: no
    escape codes, and the marked text is exactly the window's targets."""
    for window in (0, 3):
        result = CliRunner().invoke(
            cli, ["inspect", str(corpus), "--window", str(window)], env=env, color=bool(env)
        )
        assert result.exit_code == 0, result.output
        assert ANSI not in result.output
        assert marked_text(result.output) == target_text(corpus, window)


def test_with_colour_targets_are_styled_not_marked(corpus):
    result = CliRunner().invoke(cli, ["inspect", str(corpus), "--window", "0"], color=True)
    assert result.exit_code == 0
    assert "\x1b[32m\x1b[1m" in result.output and "[[" not in result.output


def run_inspect(corpus: Path, env: dict[str, str], terminal: bool) -> str:
    """``nedolm-sft inspect`` as a real process, its stdout a pseudo-terminal or a pipe."""
    command = [sys.executable, "-m", "nedolm_sft", "inspect", str(corpus), "--window", "0"]
    environ = {k: v for k, v in os.environ.items() if k != "NO_COLOR"} | env
    if not terminal:
        proc = subprocess.run(command, capture_output=True, text=True, env=environ, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout
    leader, follower = pty.openpty()
    with subprocess.Popen(command, stdout=follower, stderr=subprocess.PIPE, env=environ) as proc:
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 1 << 16)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=300) == 0, proc.stderr.read() if proc.stderr else ""
    os.close(leader)
    return b"".join(chunks).decode().replace("\r\n", "\n")


@pytest.mark.parametrize(
    ("env", "terminal", "coloured"),
    [({}, False, False), ({"NO_COLOR": "1"}, True, False), ({}, True, True)],
    ids=["pipe", "terminal-NO_COLOR", "terminal"],
)
def test_real_process_marks_targets_exactly_when_colour_is_off(corpus, env, terminal, coloured):
    output = run_inspect(corpus, env, terminal)
    assert (ANSI in output) == coloured
    if coloured:
        assert "[[" not in output
    else:
        assert marked_text(output) == target_text(corpus, 0)
