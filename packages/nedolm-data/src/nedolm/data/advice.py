"""What the build's counts mean and what a user can do about them (``prepare`` prints these).

One hint per drop reason (the two length drops say how long against ``--seq-len``), the hint
for a record that stopped the build, and one warning each for characters the tokenizer loses
and for duplicate conversations once they pass a share of the corpus.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nedolm.data.packing import DROP_HARD_CONTINUATION, DROP_MESSAGE_TOO_LONG, DROP_NO_TARGET
from nedolm.data.sources import (
    CONTROL_TOKEN_IN_CONTENT,
    DUPLICATE_CONVERSATION,
    DUPLICATE_RECORD,
    EMPTY_CONTENT,
    INVALID_JSON,
    INVALID_MESSAGE,
    INVALID_TOOL_CALL,
    INVALID_UTF8,
    LINE_TOO_LONG,
    MISSING_MESSAGES,
    NON_STRING_CONTENT,
    SPECIAL_TOKEN_IN_CONTENT,
    UNKNOWN_TOKEN,
    UNSUPPORTED_ROLE,
)

if TYPE_CHECKING:  # the builder refuses through ``drops``, which uses this module's hints
    from nedolm.data.builder import BuildReport

LOST_WARNING = 0.001
"""Warn when the tokenizer loses more than this share of the kept content's characters."""
DUPLICATE_WARNING = 0.01
"""Warn when more than this share of the kept records repeat an earlier conversation."""

_HINTS = {
    INVALID_UTF8: "text that is not UTF-8; re-encode the file as UTF-8",
    INVALID_JSON: "not a JSON object (malformed, cut, or a bare value); fix the record",
    MISSING_MESSAGES: "no 'messages'/'conversations' list and no Alpaca 'instruction'/'output';"
    " name the key holding the turns with --messages-field",
    INVALID_MESSAGE: "a malformed message, 'weight', 'history', 'tools' or ShareGPT turn;"
    " fix the record",
    EMPTY_CONTENT: "a message whose content is empty or encodes to no tokens; fill or remove it",
    NON_STRING_CONTENT: "content that is not a string (e.g. a list of parts); make it text",
    CONTROL_TOKEN_IN_CONTENT: "text already holding <|mesaj_basla|> or <|mesaj_bitir|>"
    " (templated twice?); give the plain messages",
    SPECIAL_TOKEN_IN_CONTENT: "typed text the tokenizer reads as a special token (e.g. '<s>');"
    " remove it from the text",
    INVALID_TOOL_CALL: "a tool call without a name or with arguments that are not JSON;"
    " fix the call",
    LINE_TOO_LONG: "a record longer than --max-line-bytes; raise it if the record is real",
    UNSUPPORTED_ROLE: "a role outside system/user/assistant/tool; map it with --map-role FROM=TO",
    UNKNOWN_TOKEN: "content with <unk> ids (characters outside the vocabulary);"
    " --unknown-tokens keep keeps and counts them, or pick a tokenizer that covers the text",
    DUPLICATE_RECORD: "a record id already used by an earlier record; make the ids unique",
    DUPLICATE_CONVERSATION: "the same tokens and targets as an earlier conversation, dropped"
    " as --dedup asks; leave --dedup out to keep them",
    DROP_NO_TARGET: "nothing to train, no assistant message is a target; check 'train': false"
    " and 'weight': 0, or pass --train-tool-calls when the only answers are tool calls",
}


def drop_hint(reason: str, seq_len: int, longest: int | None = None) -> str:
    """What records dropped for ``reason`` are and what to do; ``longest`` is the longest
    message among the length drops (``BuildReport.drop_longest``; None where unknown, as in
    ``stats``, which reads a manifest that does not record it)."""
    length = "" if longest is None else f" (longest: {longest})"
    if reason == DROP_HARD_CONTINUATION:
        return (
            f"an assistant message longer than --seq-len {seq_len} tokens{length};"
            " raise --seq-len or split it"
        )
    if reason == DROP_MESSAGE_TOO_LONG:
        return (
            f"a context message (system, user or tool) longer than --seq-len {seq_len} tokens"
            f"{length}; raise --seq-len or shorten it"
        )
    return _HINTS.get(reason, "see the examples")


def stop_hint(reason: str) -> str:
    """What turns the stop on a bad record of ``reason`` into a counted drop."""
    if reason == UNKNOWN_TOKEN:
        return "--unknown-tokens keep (the default) keeps and counts such records"
    return "--on-bad-record drop drops and counts such records instead"


def build_warnings(report: BuildReport) -> list[str]:
    """One line each for lost characters and duplicate conversations above their threshold."""
    warnings = []
    lost = sum(s.lost_characters or 0 for s in report.sources)
    if report.content_characters and lost > LOST_WARNING * report.content_characters:
        warnings.append(
            f"warning: the tokenizer loses {lost} characters"
            f" ({lost / report.content_characters:.2%} of the content: the lost column): encode"
            " → decode does not give them back (characters outside its vocabulary, newlines or"
            " runs of spaces its normaliser folds), so the model never sees them;"
            " --unknown-tokens drop drops records with unknown characters, a tokenizer with"
            " byte fallback keeps everything"
        )
    kept = sum(s.kept for s in report.sources)
    kept_duplicates = sum(s.duplicate_conversations or 0 for s in report.sources) - sum(
        s.dropped.get(DUPLICATE_CONVERSATION, 0) for s in report.sources
    )
    if kept and kept_duplicates > DUPLICATE_WARNING * kept:
        warnings.append(
            f"warning: {kept_duplicates} kept conversations ({kept_duplicates / kept:.1%}: the"
            " dups column) repeat an earlier one token for token, so training sees them more"
            " than once; --dedup drops them"
        )
    return warnings
