"""Reading chat JSONL: OpenAI ``messages`` records and Alpaca ``instruction/input/output`` records.

A record becomes a ``Conversation`` (roles from the registry, content text, trainable flags) or
a ``Rejected`` with a reason code and a message naming the file and line. Whether a rejection
stops the build or is dropped and counted is the builder's decision (``RecordPolicy``), so every
reason is reported the same way either way.

Targets (SPEC §2): only assistant messages are trainable; an assistant message that says
``"train": false`` is context only, and so is one that carries ``tool_calls`` unless the policy
trains tool calls (``prepare --train-tool-calls``). Tool calls are rendered after the message
content, one line per call, and a record's ``tools`` schemas are appended to its system message
(``render.tool_call_line`` / ``render.system_text``); ``tool`` messages are context.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from nedolm.data.records import (
    MESSAGE_END_TOKEN,
    MESSAGE_START_TOKEN,
    ROLE_ASSISTANT,
    ROLE_NAMES,
    ROLE_SYSTEM,
    ROLE_USER,
)
from nedolm.data.render import assistant_text, system_text, tool_call_line

# Rejection reasons. The first group is bad input (error unless the user drops invalid records);
# unsupported roles have their own policy.
INVALID_UTF8 = "invalid_utf8"
INVALID_JSON = "invalid_json"
MISSING_MESSAGES = "missing_messages"
INVALID_MESSAGE = "invalid_message"
EMPTY_CONTENT = "empty_content"
NON_STRING_CONTENT = "non_string_content"
CONTROL_TOKEN_IN_CONTENT = "control_token_in_content"
SPECIAL_TOKEN_IN_CONTENT = "special_token_in_content"
DUPLICATE_RECORD = "duplicate_record"
DUPLICATE_CONVERSATION = "duplicate_conversation"
UNKNOWN_TOKEN = "unknown_token"
UNSUPPORTED_ROLE = "unsupported_role"
INVALID_TOOL_CALL = "invalid_tool_call"
LINE_TOO_LONG = "line_too_long"
MAX_LINE_BYTES = 8 << 20

_CONTROL_STRINGS = (MESSAGE_START_TOKEN, MESSAGE_END_TOKEN)
_ROLE_CODES = {name: code for code, name in enumerate(ROLE_NAMES)}


class InputError(ValueError):
    """Bad input the user asked to stop on; the message names the file and line."""


class BadRecordError(InputError):
    """A record the policy stops on (``reason``), where dropping it was an option."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class RecordPolicy:
    """What to do with records that cannot become a conversation as they are."""

    invalid_records: str = "error"  # "error" | "drop": malformed JSON, empty content, ...
    unsupported_roles: str = "error"  # "error" | "drop": a role outside system/user/assistant
    role_map: dict[str, str] = field(default_factory=dict)  # e.g. {"tool": "user"}; context only
    train_tool_calls: bool = False  # assistant messages with tool_calls become targets
    unknown_tokens: str = "keep"  # "keep" (counted) | "drop" | "error": content with <unk> ids

    def __post_init__(self) -> None:
        for name in ("invalid_records", "unsupported_roles"):
            if getattr(self, name) not in ("error", "drop"):
                raise ValueError(f"{name} must be 'error' or 'drop', not {getattr(self, name)!r}")
        if self.unknown_tokens not in ("keep", "drop", "error"):
            raise ValueError(
                f"unknown_tokens must be 'keep', 'drop' or 'error', not {self.unknown_tokens!r}"
            )
        for source, target in self.role_map.items():
            if target not in _ROLE_CODES:
                raise ValueError(f"role map {source}={target}: target must be one of {ROLE_NAMES}")

    def stops_on(self, reason: str) -> bool:
        policy = {UNSUPPORTED_ROLE: self.unsupported_roles, UNKNOWN_TOKEN: self.unknown_tokens}
        return policy.get(reason, self.invalid_records) == "error"


@dataclass(frozen=True)
class Message:
    role: int  # ROLE_SYSTEM / ROLE_USER / ROLE_ASSISTANT / ROLE_TOOL
    text: str
    trainable: bool


@dataclass(frozen=True)
class Conversation:
    doc_key: int
    messages: tuple[Message, ...]


@dataclass(frozen=True)
class SourceLabel:
    """How one input's records are named: ``name`` in record keys and the build report,
    ``where(number)`` in messages: ``train.jsonl:17`` (a line or row number) or, for the
    elements of a JSON array, ``train.json: record 17`` (the 0-based index, as ``jq '.[17]'``).
    """

    name: str
    indexed: bool = False  # the input is one JSON array

    def where(self, number: int) -> str:
        return f"{self.name}: record {number}" if self.indexed else f"{self.name}:{number}"


@dataclass(frozen=True)
class Rejected:
    reason: str
    message: str  # "<file>:<line>: <what is wrong>"
    tokens: int = 0  # message_too_long, hard_continuation: the longest such message's length
    target_tokens: int = 0  # a document the plan cannot use: the assistant targets it held


class _Reject(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def doc_key(source_name: str, record_id: str) -> int:
    """Stable 64-bit key of a record: its file name and its ``id`` (or line number)."""
    digest = hashlib.blake2b(f"{source_name}\0{record_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def parse_record(
    raw: bytes, source_name: str, line_no: int, policy: RecordPolicy, where: str | None = None
) -> Conversation | Rejected:
    """One record's JSON → a conversation, or the first reason it cannot be one.

    ``where`` names the record in the rejection (default ``source_name:line_no``; see
    ``SourceLabel``).
    """
    try:
        return _parse(raw, source_name, line_no, policy)
    except _Reject as reject:
        return Rejected(reject.reason, f"{where or f'{source_name}:{line_no}'}: {reject}")


def _parse(raw: bytes, source_name: str, line_no: int, policy: RecordPolicy) -> Conversation:
    try:
        record = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as utf8:
            raise _Reject(INVALID_UTF8, f"invalid UTF-8 at byte {utf8.start}") from None
        raise _Reject(INVALID_JSON, f"malformed JSON: {exc}") from None
    if not isinstance(record, dict):
        raise _Reject(INVALID_JSON, f"a record must be a JSON object, not {type(record).__name__}")
    if "messages" in record:
        messages = _with_tools(_chat_messages(record["messages"], policy), record.get("tools"))
    elif "instruction" in record and "output" in record:
        messages = _alpaca_messages(record)
    else:
        raise _Reject(
            MISSING_MESSAGES,
            "no 'messages' list (OpenAI chat) and no 'instruction'/'output' (Alpaca)",
        )
    record_id = record.get("id")
    key_id = str(record_id) if isinstance(record_id, (str, int)) else f"line:{line_no}"
    return Conversation(doc_key=doc_key(source_name, key_id), messages=messages)


def _chat_messages(raw_messages: Any, policy: RecordPolicy) -> tuple[Message, ...]:
    if not isinstance(raw_messages, list) or not raw_messages:
        raise _Reject(MISSING_MESSAGES, "'messages' must be a non-empty list")
    messages = []
    for i, item in enumerate(raw_messages):
        if not isinstance(item, dict) or not isinstance(item.get("role"), str):
            raise _Reject(INVALID_MESSAGE, f"messages[{i}] must be an object with a string 'role'")
        role_name = policy.role_map.get(item["role"], item["role"])
        if role_name not in _ROLE_CODES:
            raise _Reject(
                UNSUPPORTED_ROLE,
                f"messages[{i}] has role {item['role']!r}; supported: {', '.join(ROLE_NAMES)}"
                " (map it with --map-role FROM=TO)",
            )
        role = _ROLE_CODES[role_name]
        tool_calls = item.get("tool_calls") if role == ROLE_ASSISTANT else None
        train = item.get("train", True)
        if not isinstance(train, bool):
            raise _Reject(INVALID_MESSAGE, f"messages[{i}]: 'train' must be true or false")
        text = _content(item.get("content"), i, allow_empty=bool(tool_calls))
        if tool_calls:
            text = assistant_text(text, _tool_call_lines(tool_calls, i))
        # A mapped role (e.g. tool=assistant) renders context; it never becomes a target.
        mapped = role_name != item["role"]
        calls_ok = not tool_calls or policy.train_tool_calls
        trainable = role == ROLE_ASSISTANT and train and calls_ok and not mapped
        trainable = trainable and message_weight(item, i)
        messages.append(Message(role=role, text=text, trainable=trainable))
    return tuple(messages)


def _alpaca_messages(record: dict[str, Any]) -> tuple[Message, ...]:
    instruction = _content(record["instruction"], "instruction")
    extra = record.get("input") or ""
    if not isinstance(extra, str):
        raise _Reject(NON_STRING_CONTENT, "'input' must be a string")
    user = f"{instruction}\n\n{_content(extra, 'input')}" if extra.strip() else instruction
    messages = [*alpaca_history(record.get("history")), Message(ROLE_USER, user, False)]
    if record.get("system"):
        messages.insert(0, Message(ROLE_SYSTEM, _content(record["system"], "system"), False))
    messages.append(Message(ROLE_ASSISTANT, _content(record["output"], "output"), True))
    return tuple(messages)


def message_weight(item: dict[str, Any], index: int) -> bool:
    """OpenAI fine-tuning's per-message ``weight``: 0 makes the message context, 1 (or none)
    leaves it as it is; anything else is refused rather than ignored."""
    weight = item.get("weight", 1)
    if weight not in (0, 1) or isinstance(weight, bool):
        raise _Reject(
            INVALID_MESSAGE, f"messages[{index}]: 'weight' must be 0 or 1, not {weight!r}"
        )
    return weight == 1


def alpaca_history(history: Any) -> list[Message]:
    """Alpaca's ``history`` ([[instruction, output], ...], oldest first) as the earlier user and
    assistant turns; a malformed history is refused rather than ignored."""
    if history is None:
        return []
    if not isinstance(history, list) or not all(
        isinstance(turn, list) and len(turn) == 2 for turn in history
    ):
        raise _Reject(INVALID_MESSAGE, "'history' must be a list of [instruction, output] pairs")
    turns = []
    for i, (instruction, output) in enumerate(history):
        turns.append(Message(ROLE_USER, _content(instruction, f"history[{i}][0]"), False))
        turns.append(Message(ROLE_ASSISTANT, _content(output, f"history[{i}][1]"), True))
    return turns


def _content(value: Any, where: int | str, allow_empty: bool = False) -> str:
    label = f"messages[{where}]" if isinstance(where, int) else f"'{where}'"
    if value is None and allow_empty:
        return ""
    if not isinstance(value, str):
        raise _Reject(
            NON_STRING_CONTENT, f"{label}: content must be a string, not {type(value).__name__}"
        )
    if not value.strip() and not allow_empty:
        raise _Reject(EMPTY_CONTENT, f"{label}: content is empty")
    for control in _CONTROL_STRINGS:
        if control in value:
            raise _Reject(
                CONTROL_TOKEN_IN_CONTENT,
                f"{label}: content contains the control string {control!r}"
                " (already templated text? control tokens are added by the builder)",
            )
    return value


def _tool_call_lines(tool_calls: Any, index: int) -> list[str]:
    """The text lines of an assistant message's calls; arguments must be JSON."""
    if not isinstance(tool_calls, list) or not all(isinstance(c, dict) for c in tool_calls):
        raise _Reject(INVALID_MESSAGE, f"messages[{index}]: 'tool_calls' must be a list of objects")
    lines = []
    for j, call in enumerate(tool_calls):
        where = f"messages[{index}].tool_calls[{j}]"
        function = call.get("function", call)
        name, arguments = function.get("name"), function.get("arguments", {})
        if not isinstance(name, str) or not name.strip():
            raise _Reject(INVALID_TOOL_CALL, f"{where}: the call has no function name")
        if isinstance(arguments, str):
            try:
                json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise _Reject(
                    INVALID_TOOL_CALL, f"{where} ({name}): arguments are not valid JSON: {exc}"
                ) from None
        else:
            arguments = json.dumps(arguments, ensure_ascii=False)
        lines.append(_content(tool_call_line(name, arguments), index))
    return lines


def _with_tools(messages: tuple[Message, ...], tools: Any) -> tuple[Message, ...]:
    """The record's ``tools`` schemas appended to its first system message (or a new one)."""
    if tools is None or tools == []:
        return messages
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _Reject(INVALID_MESSAGE, "'tools' must be a list of objects")
    if messages[0].role == ROLE_SYSTEM:
        system = Message(ROLE_SYSTEM, system_text(messages[0].text, tools), False)
        return (system, *messages[1:])
    return (Message(ROLE_SYSTEM, system_text(None, tools), False), *messages)
