"""ShareGPT records (``conversations: [{from, value}]``) → OpenAI ``messages`` records.

The mapping follows LLaMA-Factory's ShareGPT layout, the common one on the Hub:

* ``human`` → ``user``, ``gpt`` → ``assistant``, ``system`` → ``system``;
* ``function_call`` → an assistant message with empty content and ``tool_calls``; its value is
  the JSON of one call ``{"name", "arguments"}`` or a list of them. Calls get the ids
  ``call_1``, ``call_2``, ... in record order; object arguments become a JSON string;
* ``observation`` and ``tool`` → a ``tool`` message answering the oldest unanswered call
  (``tool_call_id`` and ``name`` of that call; neither when no call is pending);
* a top-level ``system`` string becomes a leading system message, a ``tools`` JSON string is
  parsed, and each tool spec without ``type`` is wrapped as ``{"type": "function", "function": spec}``;
* every other key (``id``, ``source``, ...) is kept as it is.

Anything else (an unknown ``from``, a call that is not JSON) raises ``ShareGPTError`` with a
reason code from ``sources`` and a message that names the turn; the reader adds file and record.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any

from nedolm.data.sources import INVALID_MESSAGE, MISSING_MESSAGES

FROM_ROLES = {
    "human": "user",
    "gpt": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function_call": "assistant",
}


class ShareGPTError(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def is_sharegpt_turns(turns: Any) -> bool:
    """True for a list whose first turn is a ``{"from": ...}`` object (ShareGPT, not OpenAI)."""
    return (
        isinstance(turns, list)
        and bool(turns)
        and isinstance(turns[0], dict)
        and "from" in turns[0]
    )


def to_openai(record: dict[str, Any], field: str = "conversations") -> dict[str, Any]:
    """The OpenAI-form record of a ShareGPT record whose turns are under ``field``."""
    turns = record[field]
    if not isinstance(turns, list) or not turns:
        raise ShareGPTError(MISSING_MESSAGES, f"{field!r} must be a non-empty list")
    messages: list[dict[str, Any]] = []
    system = record.get("system")
    if isinstance(system, str) and system.strip():
        messages.append({"role": "system", "content": system})
    pending: deque[tuple[str, str]] = deque()  # (id, name) of calls not yet answered
    calls = 0
    for i, turn in enumerate(turns):
        where = f"{field}[{i}]"
        if not isinstance(turn, dict) or not isinstance(turn.get("from"), str):
            raise ShareGPTError(INVALID_MESSAGE, f"{where} must be an object with a string 'from'")
        sender, value = turn["from"], turn.get("value")
        if sender not in FROM_ROLES:
            raise ShareGPTError(
                INVALID_MESSAGE,
                f"{where} has unknown 'from' {sender!r}; ShareGPT roles: {', '.join(FROM_ROLES)}",
            )
        if sender == "function_call":
            tool_calls = []
            for call in _calls(value, where):
                calls += 1
                tool_calls.append({"id": f"call_{calls}", "type": "function", "function": call})
                pending.append((f"call_{calls}", call["name"]))
            messages.append({"role": "assistant", "content": "", "tool_calls": tool_calls})
        elif FROM_ROLES[sender] == "tool" and pending:
            call_id, name = pending.popleft()
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "name": name, "content": value}
            )
        else:
            messages.append({"role": FROM_ROLES[sender], "content": value})
    out: dict[str, Any] = {"messages": messages}
    for key, value in record.items():
        if key == "tools":
            out[key] = _tools(value)
        elif key not in (field, "system"):
            out[key] = value
    return out


def _calls(value: Any, where: str) -> list[dict[str, str]]:
    try:
        parsed = json.loads(value) if isinstance(value, str) else None
    except json.JSONDecodeError as exc:
        raise ShareGPTError(INVALID_MESSAGE, f"{where}: function_call is not JSON: {exc}") from None
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ShareGPTError(
                INVALID_MESSAGE,
                f'{where}: function_call must be JSON {{"name", "arguments"}} or a list of them',
            )
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        out.append({"name": call["name"], "arguments": arguments})
    return out


def _tools(value: Any) -> Any:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise ShareGPTError(INVALID_MESSAGE, f"'tools' is not JSON: {exc}") from None
    if not isinstance(value, list):
        return value
    return [
        tool
        if not isinstance(tool, dict) or "type" in tool
        else {"type": "function", "function": tool}
        for tool in value
    ]
