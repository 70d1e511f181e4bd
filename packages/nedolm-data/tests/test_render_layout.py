"""The conversation renderer: the ids and segment records SPEC §2 defines, written out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from nedolm.data.records import INDEX_DTYPE, ROLE_ASSISTANT, ROLE_SYSTEM, ROLE_USER
from nedolm.data.render import ConversationLayout, LayoutError, chat_template, message_segments

LAYOUT = ConversationLayout(
    start_id=100, end_id=101, eos_id=2, headers={"system": [7], "user": [8, 9], "assistant": [10]}
)


def test_document_prompt_and_segments_follow_spec_section_2() -> None:
    roles, contents = ["system", "user", "assistant"], [[20], [21, 22], [23, 24, 25]]
    assert LAYOUT.document(roles, contents) == [
        *(100, 7, 20, 101),
        *(100, 8, 9, 21, 22, 101),
        *(100, 10, 23, 24, 25, 101),
        2,
    ]
    assert LAYOUT.prompt(roles[:2], contents[:2]) == [
        *(100, 7, 20, 101),
        *(100, 8, 9, 21, 22, 101),
        *(100, 10),
    ]
    segments = message_segments(
        np.array([3]),
        np.array([ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT]),
        np.array([1, 2, 1]),
        np.array([1, 2, 3]),
        np.array([True, True, True]),  # only the assistant message can carry targets
    )
    assert segments["start"].tolist() == [0, 4, 10]
    assert segments["length"].tolist() == [4, 6, 6]
    assert segments["header_len"].tolist() == [2, 3, 2]
    assert segments["trainable"].tolist() == [0, 0, 1]


def test_segments_restart_at_every_document_and_place_control_ids_matches_document() -> None:
    """Vectorised over many documents == one document at a time."""
    roles = np.array([ROLE_USER, ROLE_ASSISTANT, ROLE_USER, ROLE_ASSISTANT, ROLE_ASSISTANT])
    header, content = np.array([2, 1, 2, 1, 1]), np.array([3, 0, 1, 4, 2])
    trainable = np.array([False, True, False, False, True])
    many = message_segments(np.array([2, 3]), roles, header, content, trainable)
    first = message_segments(np.array([2]), roles[:2], header[:2], content[:2], trainable[:2])
    second = message_segments(np.array([3]), roles[2:], header[2:], content[2:], trainable[2:])
    assert many.tobytes() == np.concatenate([first, second]).tobytes()

    names = ["user", "assistant", "user", "assistant", "assistant"]
    ids = [list(range(30, 30 + n)) for n in content]
    documents = [LAYOUT.document(names[:2], ids[:2]), LAYOUT.document(names[2:], ids[2:])]
    expected = np.array(documents[0] + documents[1])
    index = np.array(
        [(0, 0, 0, len(documents[0]), 2), (1, len(documents[0]), 2, len(documents[1]), 3)],
        INDEX_DTYPE,
    )
    tokens = np.where(np.isin(expected, [100, 101, 2]), 0, expected)
    LAYOUT.place_control_ids(tokens, index, many)
    assert tokens.tolist() == expected.tolist()


def test_unknown_role_is_a_clear_error() -> None:
    with pytest.raises(
        LayoutError, match="unknown role 'tool'; known: \\['assistant', 'system', 'user'\\]"
    ):
        LAYOUT.prompt(["tool"], [[20]])


def test_chat_template_is_built_from_the_layout_constants() -> None:
    template = chat_template("</s>")
    assert "<|mesaj_basla|>" in template and "<|mesaj_bitir|>" in template
    for word in ("sistem\n", "kullanici\n", "asistan\n"):
        assert word in template
    assert template.endswith(
        "{% if add_generation_prompt %}<|mesaj_basla|>asistan\n{% else %}</s>{% endif %}"
    )
