"""``nedolm-sft generate`` and ``nedolm-sft chat``: talk to a trained model, streaming tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from nedolm_sft.chat_model import ChatModel, load_chat_model, resolve_placement

data_dir_option = click.option(
    "--data-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="For a base run: the prepared corpus whose tokenizer to use (needed after init-base).",
)

DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
"""torch's dtype names and the short ones the config uses (``train.precision: bf16``), each to
torch's: a --dtype takes either."""


def dtype_option(choices: list[str], default: str, description: str) -> Callable[..., Any]:
    """A --dtype option taking ``choices`` plus DTYPE_NAMES' aliases; the value is torch's name."""
    return click.option(
        "--dtype",
        type=click.Choice([*choices, *sorted(DTYPE_NAMES)]),
        default=default,
        show_default=True,
        callback=lambda _ctx, _param, value: DTYPE_NAMES.get(value, value),
        help=description,
    )


placement_options = [
    click.option(
        "--device",
        default="auto",
        show_default=True,
        help="cpu, cuda or cuda:N; auto = cuda when available, else cpu.",
    ),
    dtype_option(
        ["auto"],
        "auto",
        "Weights and KV cache dtype (bf16, fp32 and fp16 name the same); auto = bfloat16 on "
        "a GPU with bf16 tensor cores (Ampere and later), else float32.",
    ),
]
sampling_options = [
    click.option("--max-new-tokens", default=128, show_default=True, help="Reply length limit."),
    click.option(
        "--temperature",
        type=click.FloatRange(min=0.0),
        default=0.0,
        show_default=True,
        help="0 = greedy; > 0 samples from softmax(logits / temperature).",
    ),
    click.option(
        "--top-p",
        type=click.FloatRange(min=0.0, max=1.0, min_open=True),
        default=1.0,
        show_default=True,
        help="Nucleus sampling: keep the most likely tokens up to this probability mass.",
    ),
    click.option(
        "--repetition-penalty",
        type=click.FloatRange(min=0.0, min_open=True),
        default=1.0,
        show_default=True,
        help="> 1 discourages tokens already in the conversation (as transformers' "
        "repetition_penalty); 1 = off.",
    ),
    click.option("--seed", default=0, show_default=True, help="Sampling seed."),
    click.option("--system", default=None, help="Optional system message."),
]


def with_chat_options(command):
    for option in reversed([data_dir_option, *placement_options, *sampling_options]):
        command = option(command)
    return command


def stream_reply(chat: ChatModel, history: list[tuple[str, str]], **sampling: object) -> str:
    """Print the reply as it is generated and return it."""
    pieces = []
    for piece in chat.reply(history, **sampling):
        click.echo(piece, nl=False)
        pieces.append(piece)
    click.echo()
    return "".join(pieces)


@click.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="The user message.")
@with_chat_options
def generate(
    model_dir: Path,
    prompt: str,
    system: str | None,
    data_dir: Path | None,
    device: str,
    dtype: str,
    **sampling: object,
) -> None:
    """Reply to one user message with a run's newest checkpoint (SFT or base) or an export.

    \b
    Example:
      nedolm-sft generate runs/sft-demo --prompt "Türkiye'nin başkenti neresidir?"
    """
    chat = load_chat_model(model_dir, data_dir, resolve_placement(device, dtype))
    history = [("system", system)] if system else []
    stream_reply(chat, [*history, ("user", prompt)], **sampling)


@click.command()
@click.argument("model_dir", type=click.Path(path_type=Path))
@with_chat_options
def chat(
    model_dir: Path,
    system: str | None,
    data_dir: Path | None,
    device: str,
    dtype: str,
    **sampling: object,
) -> None:
    """Chat interactively (empty line or Ctrl-D ends; /reset starts over).

    \b
    Example:
      nedolm-sft chat exports/sft-demo --temperature 0.7 --top-p 0.9
    """
    model = load_chat_model(model_dir, data_dir, resolve_placement(device, dtype))
    start = [("system", system)] if system else []
    history = list(start)
    click.echo(f"chatting with {model.source} (empty line to quit, /reset to start over)")
    while True:
        try:
            text = click.prompt("sen", default="", show_default=False, prompt_suffix="> ")
        except click.exceptions.Abort:
            break
        if not text.strip():
            break
        if text.strip() == "/reset":
            history = list(start)
            continue
        history.append(("user", text))
        click.echo("asistan> ", nl=False)
        history.append(("assistant", stream_reply(model, history, **sampling)))
