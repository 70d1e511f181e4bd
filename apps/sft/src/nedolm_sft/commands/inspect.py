"""``nedolm-sft inspect``: show training windows with their targets highlighted (nedolm.data)."""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import click

from nedolm.data.contract import DatasetContractError, audited_seq_len
from nedolm.data.format import ShardFormatError
from nedolm.data.inspect import (
    InspectError,
    PieceView,
    WindowView,
    corpus_decoder,
    document_windows,
    iter_plan_rows,
    window_view,
)
from nedolm.data.packing import PackingError, discover_sft_shards
from nedolm.data.records import ROLE_HEADERS
from nedolm.data.render import is_tool_call_line

TARGET_OPEN, TARGET_CLOSE = "[[", "]]"
"""How targets are marked when colour is off (piped output, NO_COLOR): ``[[trained text]]``."""


def colour_on() -> bool:
    """Whether ``inspect`` styles its text: when click would keep the styles (a terminal, or a
    caller forcing colour) and ``NO_COLOR`` is unset (https://no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    return not click.utils.should_strip_ansi(sys.stdout, click.get_current_context().color)


def render_piece(
    piece: PieceView, decode: Callable[[list[int]], str] | None, colour: bool = True
) -> str:
    """A piece as text: role markers at message starts, targets in bold green, or marked
    ``[[...]]`` without colour (styles alone would vanish from piped output)."""
    style = click.style if colour else _unstyled
    head = (
        f"── shard {piece.shard_id} doc {piece.doc} (key {piece.doc_key:016x}) "
        f"tokens [{piece.start}, {piece.end}) targets from {piece.target_from} ──"
    )
    out = [style(head, dim=True), "\n"]
    for run in piece.runs:
        if run.part == "header":
            word = ROLE_HEADERS[run.role]
            fg = "yellow" if run.role == "tool" else "cyan"
            out.append(style(f"⟦{word}⟧ " if run.message_start else "⟦…⟧ ", fg=fg))
        elif run.part == "eos":
            out.append(style("⟨eos⟩", fg="magenta") + "\n")
        else:
            if run.part == "end":
                text = "⟨/⟩"
            elif decode is None:
                text = " ".join(map(str, run.token_ids)) + " "
            else:
                text = decode(run.token_ids)
            if run.message_start:  # the window starts inside this message (hard continuation)
                text = "⟦…⟧ " + text
            calls = run.role == "assistant"
            out.extend(_styled_lines(text, run.target, calls, colour))
            if run.part == "end":
                out.append("\n")
    text = "".join(out)
    # Without colour, a message's content and end token are one marked span, not two.
    return text if colour else text.replace(TARGET_CLOSE + TARGET_OPEN, "")


def _unstyled(text: str, **_: object) -> str:
    return text


def _styled_lines(text: str, target: bool, calls: bool, colour: bool) -> list[str]:
    """Content text: targets bold green (or marked); tool-call lines of an assistant message
    marked ⚙."""
    out = []
    lines = text.splitlines(keepends=True)
    for is_call, group in itertools.groupby(lines, lambda line: calls and is_tool_call_line(line)):
        if is_call and colour:
            out.extend(click.style(f"⚙ {line}", fg="yellow", bold=target) for line in group)
        elif is_call:
            out.extend(f"⚙ {_marked(line) if target else line}" for line in group)
        elif target:
            part = "".join(group)
            out.append(click.style(part, fg="green", bold=True) if colour else _marked(part))
        else:
            out.append("".join(group))
    return out


def _marked(text: str) -> str:
    """``[[text]]``, the mark placed before the text's final newline so lines stay lines."""
    body = text.rstrip("\n")
    return f"{TARGET_OPEN}{body}{TARGET_CLOSE}{text[len(body) :]}"


def render_window(
    view: WindowView, decode: Callable[[list[int]], str] | None, colour: bool = True
) -> str:
    style = click.style if colour else _unstyled
    padding = view.row_len - view.tokens
    head = (
        f"window {view.window} (shard {view.shard_id}, window {view.local_window}): "
        f"{len(view.pieces)} pieces, {view.tokens} tokens, {view.targets} targets, "
        f"{padding} padding"
    )
    body = "".join(render_piece(piece, decode, colour) for piece in view.pieces)
    tail = style(f"⟨pad × {padding}⟩", dim=True) if padding else ""
    return f"{style(head, bold=True)}\n{body}{tail}"


def view_json(view: WindowView) -> dict:
    return {
        "window": view.window,
        "shard": view.shard_id,
        "local_window": view.local_window,
        "tokens": view.tokens,
        "targets": view.targets,
        "pieces": [
            {
                "doc": p.doc,
                "doc_key": p.doc_key,
                "start": p.start,
                "end": p.end,
                "target_from": p.target_from,
                "runs": [
                    {
                        "part": r.part,
                        "role": r.role,
                        "target": r.target,
                        "token_ids": r.token_ids,
                    }
                    for r in p.runs
                ],
            }
            for p in view.pieces
        ],
    }


@click.command("inspect")
@click.argument("data_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--seq-len",
    type=click.IntRange(min=1),
    help="Plan for this context (default: the seq_len of the corpus's packing audit).",
)
@click.option("--window", type=click.IntRange(min=0), help="Global window number (default 0).")
@click.option(
    "--doc", type=click.IntRange(min=0), help="Show the windows of this global document number."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--all", "all_windows", is_flag=True, help="Every window; with --json one line per window."
)
def inspect(
    data_dir: Path,
    seq_len: int | None,
    window: int | None,
    doc: int | None,
    as_json: bool,
    all_windows: bool,
) -> None:
    """Show training windows of DATA_DIR with targets highlighted and messages marked.

    Windows are numbered across shards in shard-id order, as the training loader numbers them.
    Targets are bold green; without colour (output piped or redirected, or NO_COLOR set) they
    are marked [[like this]]. ⟦role⟧ marks a message start, ⟨/⟩ a message end, ⚙ a tool call.

    \b
    Examples:
      nedolm-sft inspect corpus/ --window 12
      nedolm-sft inspect corpus/ --all --json > plan.jsonl
    """
    if sum(x is not None and x is not False for x in (window, doc, all_windows)) > 1:
        raise click.UsageError("--window, --doc and --all are mutually exclusive")
    if not seq_len:
        try:
            seq_len = audited_seq_len(data_dir)
        except DatasetContractError as exc:
            raise click.UsageError(f"{exc}; pass --seq-len") from exc
    try:
        shards = discover_sft_shards(data_dir, seq_len)
        if all_windows and as_json:
            for record in iter_plan_rows(shards):
                click.echo(json.dumps(record))
            return
        if all_windows:
            windows = list(range(sum(s.plan.counts.windows for s in shards)))
        elif doc is not None:
            windows = document_windows(shards, doc)
        else:
            windows = [window or 0]
        views = [window_view(shards, w) for w in windows]
    except (InspectError, ShardFormatError, PackingError) as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(
            json.dumps([view_json(v) for v in views] if doc is not None else view_json(views[0]))
        )
        return
    decode = corpus_decoder(data_dir)
    colour = colour_on()
    for view in views:
        click.echo(render_window(view, decode, colour), color=colour)
