"""The conversation layout (SPEC §2), in one place: training documents, prompts, chat template.

A message is ``<|mesaj_basla|>`` + role header + content + ``<|mesaj_bitir|>``; a document (a
whole conversation) ends with EOS. The role header is the tokenizer's encoding of
``ROLE_HEADER_FORMAT`` filled with the role's Turkish word. Targets are the content and the
closing ``<|mesaj_bitir|>`` of trainable assistant messages.

Every user of the layout goes through this module: the builder and the synthetic corpora
(``message_segments`` + ``ConversationLayout.document``/``place_control_ids``), generation
and chat (``ConversationLayout.prompt``: the messages plus an open assistant turn) and the
Hugging Face export (``chat_template``: the same layout as Jinja text). A new role is a new
entry of the role registry (``records.ROLE_HEADERS``); which messages carry targets is
decided in ``message_segments``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from nedolm.data.format import SpecialTokens
from nedolm.data.records import (
    MESSAGE_END_TOKEN,
    MESSAGE_START_TOKEN,
    ROLE_ASSISTANT,
    ROLE_HEADERS,
    SEGMENT_DTYPE,
)

ROLE_HEADER_FORMAT = "{word}\n"
"""The text whose encoding is a role's header tokens (``"asistan\\n"``)."""

GENERATION_ROLE = "assistant"
"""The role of the open turn a prompt ends with: the model writes its content."""

TOOLS_HEADER = "Kullanılabilir araçlar:"
"""The first line of the tools block appended to the system message (one JSON line per tool)."""


class LayoutError(ValueError):
    """A conversation the layout cannot render (an unknown role); names the role."""


def role_header_text(word: str) -> str:
    return ROLE_HEADER_FORMAT.format(word=word)


def tool_call_line(name: str, arguments: str) -> str:
    """One call of an assistant message as text: ``{"name": "f", "arguments": {...}}``.

    ``arguments`` is the call's JSON text as given (already checked to be JSON).
    """
    return f'{{"name": {_json(name)}, "arguments": {arguments}}}'


def is_tool_call_line(line: str) -> bool:
    """Whether a line of an assistant message's text is a ``tool_call_line``."""
    line = line.rstrip("\n")
    return line.startswith('{"name": ') and ', "arguments": ' in line and line.endswith("}")


def assistant_text(content: str, call_lines: Sequence[str]) -> str:
    """An assistant message's text: its content, then one line per tool call."""
    calls = "\n".join(call_lines)
    if not calls:
        return content
    return f"{content}\n{calls}" if content.strip() else calls


def tools_block(tools: Sequence[Mapping]) -> str:
    """The tool schemas of a record as text for the system message: a header, one JSON line each
    (keys sorted, so the text does not depend on the order a file format kept them in)."""
    return "\n".join([TOOLS_HEADER, *(_json(tool, sort_keys=True) for tool in tools)])


def system_text(system: str | None, tools: Sequence[Mapping]) -> str | None:
    """The system message with the tools block appended (or the block alone when none)."""
    if not tools:
        return system
    block = tools_block(tools)
    return f"{system}\n\n{block}" if system is not None else block


def _json(value: object, sort_keys: bool = False) -> str:
    """``json.dumps`` as Hugging Face's ``tojson`` Jinja filter writes it (non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False, sort_keys=sort_keys)


def message_segments(
    counts: np.ndarray,
    role: np.ndarray,
    header_len: np.ndarray,
    content_len: np.ndarray,
    trainable: np.ndarray,
) -> np.ndarray:
    """Segment records (SEGMENT_DTYPE) of many documents; document ``i`` has ``counts[i]`` messages.

    ``header_len`` counts the role header tokens only; the record's ``header_len`` adds the
    ``<|mesaj_basla|>`` before them and its ``length`` the ``<|mesaj_bitir|>`` after the content.
    Starts are document-relative. Vectorised: millions of messages in one call.
    """
    counts = np.asarray(counts, np.int64)
    header = np.asarray(header_len, np.int64) + 1
    length = header + np.asarray(content_len, np.int64) + 1
    running = np.cumsum(length) - length  # exclusive prefix over all messages
    first_message = np.cumsum(counts) - counts
    doc_of = np.repeat(np.arange(len(counts)), counts)
    segments = np.empty(len(length), SEGMENT_DTYPE)
    segments["start"] = running - running[first_message][doc_of] if len(length) else running
    segments["length"] = length
    segments["header_len"] = header
    segments["role"] = role
    segments["trainable"] = np.asarray(trainable, bool) & (np.asarray(role) == ROLE_ASSISTANT)
    return segments


@dataclass(frozen=True)
class ConversationLayout:
    """The corpus's ids for the layout: control tokens, EOS and each role's header tokens."""

    start_id: int
    end_id: int
    eos_id: int
    headers: Mapping[str, Sequence[int]]  # role name -> header token ids

    @classmethod
    def from_specials(cls, specials: SpecialTokens) -> ConversationLayout:
        return cls(
            start_id=specials.message_start_id,
            end_id=specials.message_end_id,
            eos_id=specials.eos_id,
            headers={role: list(ids) for role, ids in specials.role_header_token_ids.items()},
        )

    def header(self, role: str) -> Sequence[int]:
        try:
            return self.headers[role]
        except KeyError:
            raise LayoutError(f"unknown role {role!r}; known: {sorted(self.headers)}") from None

    def messages(self, roles: Sequence[str], contents: Sequence[Sequence[int]]) -> list[int]:
        """Token ids of closed messages: ``(role, content ids)`` pairs, no EOS."""
        ids: list[int] = []
        for role, content in zip(roles, contents, strict=True):
            ids += [self.start_id, *self.header(role), *content, self.end_id]
        return ids

    def document(self, roles: Sequence[str], contents: Sequence[Sequence[int]]) -> list[int]:
        """A whole conversation as the builder writes it: its messages, then EOS."""
        return [*self.messages(roles, contents), self.eos_id]

    def prompt(self, roles: Sequence[str], contents: Sequence[Sequence[int]]) -> list[int]:
        """The messages followed by an open assistant turn, for the model to continue."""
        return [*self.messages(roles, contents), self.start_id, *self.header(GENERATION_ROLE)]

    def place_control_ids(
        self, tokens: np.ndarray, index: np.ndarray, segments: np.ndarray
    ) -> None:
        """Write the control ids and EOS into a shard's ``tokens`` in place, vectorised.

        ``index``/``segments`` are the shard's records; the positions written are the ones
        ``document`` fills with them. Headers and content are left as they are.
        """
        start = message_starts(index, segments)
        tokens[start] = self.start_id
        tokens[start + segments["length"].astype(np.int64) - 1] = self.end_id
        ends = index["token_start"].astype(np.int64) + index["token_len"].astype(np.int64) - 1
        tokens[ends] = self.eos_id


def message_starts(index: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """Shard-relative position of every message's ``<|mesaj_basla|>``."""
    doc_of = np.repeat(np.arange(len(index)), index["segment_count"].astype(np.int64))
    return index["token_start"].astype(np.int64)[doc_of] + segments["start"].astype(np.int64)


def chat_template(eos_token: str, roles: Mapping[str, str] = ROLE_HEADERS) -> str:
    """The layout as a Hugging Face chat template (Jinja), for ``tokenizer_config.json``.

    A full conversation renders like ``ConversationLayout.document`` (EOS last); with
    ``add_generation_prompt`` like ``ConversationLayout.prompt``. An unknown role is an error.
    Assistant ``tool_calls`` and the ``tools`` argument render as the builder renders them
    (``assistant_text`` of ``tool_call_line``s, ``system_text``).
    """
    headers = "".join(
        f"{{% {'if' if i == 0 else 'elif'} message['role'] == '{role}' %}}{role_header_text(word)}"
        for i, (role, word) in enumerate(roles.items())
    )
    unknown = "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    open_turn = MESSAGE_START_TOKEN + role_header_text(roles[GENERATION_ROLE])
    system_turn = MESSAGE_START_TOKEN + role_header_text(roles["system"])
    return (
        f"{_TOOLS_JINJA}"
        f"{{% if ns.tools and messages[0]['role'] != 'system' %}}"
        f"{system_turn}{{{{ ns.tools }}}}{MESSAGE_END_TOKEN}{{% endif %}}"
        f"{{% for message in messages %}}{MESSAGE_START_TOKEN}{headers}{unknown}"
        f"{_CONTENT_JINJA}{{{{ content }}}}{MESSAGE_END_TOKEN}{{% endfor %}}"
        f"{{% if add_generation_prompt %}}{open_turn}{{% else %}}{eos_token}{{% endif %}}"
    )


_TOOLS_JINJA = (
    "{% set ns = namespace(tools='', calls='') %}"
    "{% if tools %}{% set ns.tools = '" + TOOLS_HEADER + "' %}"
    "{% for tool in tools %}{% set ns.tools = ns.tools + '\\n' + (tool | tojson(sort_keys=True)) %}"
    "{% endfor %}{% endif %}"
)
"""``tools_block`` in Jinja: ``ns.tools`` is the block, or empty without tools."""

_CONTENT_JINJA = (
    "{% set content = message['content'] if message['content'] is string else '' %}"
    "{% if loop.first and message['role'] == 'system' and ns.tools %}"
    "{% set content = content + '\\n\\n' + ns.tools %}{% endif %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}{% set ns.calls = '' %}"
    "{% for call in message['tool_calls'] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{% set a = f['arguments'] if f['arguments'] is defined else {} %}"
    "{% set a = a if a is string else (a | tojson) %}"
    "{% set ns.calls = ns.calls + ('' if loop.first else '\\n')"
    " + '{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' + a + '}' %}"
    "{% endfor %}"
    "{% set content = (content + '\\n' + ns.calls) if content | trim else ns.calls %}{% endif %}"
)
"""A message's text in Jinja: ``system_text`` for the first system message, ``assistant_text``
of its ``tool_call_line``s for an assistant message with calls, else its content."""
