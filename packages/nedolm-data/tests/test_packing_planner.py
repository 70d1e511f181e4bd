"""The planner on hand-worked examples (the one in FORMAT.md), drop reasons and bad records."""

import numpy as np
import pytest

from nedolm.data.packing import (
    PIECE_DTYPE,
    PackingCounts,
    PackingError,
    document_drop_reason,
    plan_shard,
)
from nedolm.data.packing_reference import plan_shard_reference
from nedolm.data.records import ROLE_ASSISTANT as A
from nedolm.data.records import ROLE_SYSTEM as S
from nedolm.data.records import ROLE_USER as U
from nedolm.data.synthetic import Conversations, layout

# (role, header_len, content_len, trainable); a message is 1 + header + content + 1 tokens long.
WORKED_EXAMPLE = [
    [(U, 2, 0, False), (A, 2, 1, True)],  # doc 0: 8 tokens, targets 5, 6
    [(U, 2, 0, False), (A, 2, 0, True)],  # doc 1: 7 tokens, target 5
    [  # doc 2: 27 tokens, longer than a window
        (S, 2, 1, False),  # [0, 4)
        (U, 2, 1, False),  # [4, 8)
        (A, 2, 6, True),  # [8, 17), targets 10..16
        (U, 2, 1, False),  # [17, 21)
        (A, 2, 2, True),  # [21, 26), targets 23..25; EOS at 26
    ],
    [(A, 2, 0, True)],  # doc 3: 4 tokens, target 2
    [(A, 2, 1, True)],  # doc 4: 5 tokens, targets 2, 3
    [(U, 2, 3, False)],  # doc 5: no target, never placed
]


def worked_example() -> tuple[np.ndarray, np.ndarray]:
    return layout(Conversations.from_lists(WORKED_EXAMPLE))


def test_worked_example_matches_hand_derivation() -> None:
    # seq_len 11 -> windows of 12 tokens. Doc 2's chain:
    #   [0, 12)  the first window, trains 10, 11
    #   [4, 16)  first untrained target 12; user at 4 keeps it inside -> turn-aligned
    #   [8, 20)  target 16; 16 - 4 = 12 is outside from the user, so the assistant start 8
    #   [17, 27) target 23; user at 17 -> turn-aligned; the tail (10 tokens, EOS included)
    # Best-fit decreasing over sizes 12, 12, 12, 10, 8, 7, 5, 4: the 12s and the 10 open
    # windows 0-3; 8 and 7 do not fit the 2 free tokens of window 3 and open windows 4 and 5;
    # 5 fits only window 5 (5 free), 4 fits window 4 (4 free, the best fit).
    plan = plan_shard(*worked_example(), seq_len=11)
    expected = np.array(
        [
            (0, 2, 0, 12, 0),
            (1, 2, 4, 16, 12),
            (2, 2, 8, 20, 16),
            (3, 2, 17, 27, 23),
            (4, 0, 0, 8, 0),
            (4, 3, 0, 4, 0),
            (5, 1, 0, 7, 0),
            (5, 4, 0, 5, 0),
        ],
        dtype=PIECE_DTYPE,
    )
    np.testing.assert_array_equal(plan.pieces, expected)
    assert plan.counts == PackingCounts(
        documents=6,
        windows=6,
        raw_tokens=58,
        valid_context_tokens=70,
        padded_tokens=2,
        assistant_target_tokens=16,
        turn_aligned_continuations=2,
        assistant_aligned_continuations=1,
        hard_continuations=0,
    )
    np.testing.assert_array_equal(plan.window_offsets, [0, 1, 2, 3, 4, 6, 8])
    reference = plan_shard_reference(*worked_example(), seq_len=11)
    np.testing.assert_array_equal(reference.pieces, plan.pieces)
    assert reference.counts == plan.counts


def test_first_window_without_target_is_not_emitted() -> None:
    # A long system prompt fills the first window; the chain starts at the user message.
    index, segments = layout(
        Conversations.from_lists([[(S, 2, 9, False), (U, 2, 1, False), (A, 2, 2, True)]])
    )
    plan = plan_shard(index, segments, seq_len=11)  # [0,12) system, [12,16) user, [16,21)
    assert plan.pieces[["start", "end", "target_from"]].tolist() == [(12, 22, 18)]
    assert plan.counts.turn_aligned_continuations == 1


def test_hard_continuation_is_counted_and_still_trains_every_target() -> None:
    index, segments = layout(Conversations.from_lists([[(U, 2, 1, False), (A, 2, 20, True)]]))
    plan = plan_shard(index, segments, seq_len=11)
    assert plan.counts.hard_continuations > 0
    assert plan.counts.assistant_target_tokens == 21
    assert document_drop_reason(segments, seq_len=11) == "hard_continuation"


def test_counts_add_over_shards() -> None:
    a = plan_shard(*worked_example(), seq_len=11).counts
    b = plan_shard(*worked_example(), seq_len=30).counts
    total = a + b
    assert total.windows == a.windows + b.windows
    assert total.assistant_target_tokens == a.assistant_target_tokens * 2


@pytest.mark.parametrize(
    ("conversation", "reason"),
    [
        ([(U, 2, 3, False), (A, 2, 3, False)], "no_target"),
        ([(U, 2, 3, False)], "no_target"),
        ([(U, 2, 3, False), (A, 2, 10, True)], "hard_continuation"),  # 13 tokens > 12
        ([(U, 2, 10, False), (A, 2, 3, True)], "message_too_long"),
        ([(S, 2, 20, False), (U, 2, 1, False), (A, 2, 2, True)], "message_too_long"),
        ([(U, 2, 3, False), (A, 2, 9, True)], None),  # a message exactly one window long
        ([(U, 2, 5, False), (A, 2, 5, True)] * 4, None),  # long document, every message fits
    ],
)
def test_document_drop_reason(conversation: list, reason: str | None) -> None:
    _, segments = layout(Conversations.from_lists([conversation]))
    assert document_drop_reason(segments, seq_len=11) == reason


def test_empty_shard() -> None:
    index, segments = layout(Conversations.from_lists([]))
    plan = plan_shard(index, segments, seq_len=8)
    assert len(plan.pieces) == 0
    assert plan.counts == PackingCounts()


def test_inconsistent_records_are_refused() -> None:
    index, segments = worked_example()
    broken = index.copy()
    broken["segment_start"][1] += 1
    with pytest.raises(PackingError, match="document 1: segment_start"):
        plan_shard(broken, segments, seq_len=11)
    with pytest.raises(PackingError, match="index counts 12 segments, found 11"):
        plan_shard(index, segments[:-1], seq_len=11)
    short = index.copy()
    short["token_len"][2] = 22
    with pytest.raises(
        PackingError, match="of document 2 ends at 26, past the document's 22 tokens"
    ):
        plan_shard(short, segments, seq_len=11)
    with pytest.raises(PackingError, match="seq_len must be positive"):
        plan_shard(index, segments, seq_len=0)
