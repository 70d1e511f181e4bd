"""Property tests of the planner on generated conversations, checked token by token."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from nedolm.data.packing import document_drop_reason, plan_shard
from nedolm.data.packing_reference import plan_shard_reference
from nedolm.data.records import ROLE_ASSISTANT, ROLE_SYSTEM, ROLE_USER
from nedolm.data.synthetic import Conversations, layout

messages = st.tuples(
    st.sampled_from([ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, ROLE_ASSISTANT]),
    st.integers(2, 4),  # header: <|mesaj_basla|> + 1..3 role tokens
    st.integers(0, 30),  # content
    st.booleans(),  # trainable (assistant only; a tool call is an untrainable assistant)
)
corpora = st.lists(st.lists(messages, min_size=1, max_size=8), max_size=25)
seq_lens = st.integers(4, 64)
SETTINGS = settings(max_examples=100, deadline=None)


def target_positions(index: np.ndarray, segments: np.ndarray, doc: int) -> set[int]:
    first, count = int(index["segment_start"][doc]), int(index["segment_count"][doc])
    return {
        p
        for m in segments[first : first + count]
        if m["trainable"]
        for p in range(int(m["start"] + m["header_len"]), int(m["start"] + m["length"]))
    }


def check_plan(index: np.ndarray, segments: np.ndarray, seq_len: int, pieces: np.ndarray) -> None:
    """Every SPEC §3 invariant of a plan, from the pieces alone."""
    window = seq_len + 1
    targets = [target_positions(index, segments, d) for d in range(len(index))]
    trained: dict[tuple[int, int], int] = {}
    windows = pieces["window"]
    assert np.array_equal(np.unique(windows), np.arange(len(np.unique(windows))))
    assert np.all(np.diff(windows.astype(np.int64)) >= 0)
    for w in np.unique(windows):
        rows = pieces[windows == w]
        assert int((rows["end"] - rows["start"]).sum()) <= window
        window_targets = 0
        for piece in rows:
            doc, start, end = int(piece["doc"]), int(piece["start"]), int(piece["end"])
            assert 0 <= start < end <= int(index["token_len"][doc])
            for p in range(max(start, int(piece["target_from"])), end):
                if p in targets[doc]:
                    trained[doc, p] = trained.get((doc, p), 0) + 1
                    window_targets += 1
        assert window_targets > 0, "a window without targets was emitted"
    expected = {(d, p) for d in range(len(index)) for p in targets[d]}
    assert set(trained) == expected, "some target is never trained"
    assert all(n == 1 for n in trained.values()), "some target is trained twice"
    for d in range(len(index)):
        doc_pieces = pieces[pieces["doc"] == d]
        if targets[d] and int(index["token_len"][d]) <= window:  # fits: never split
            assert doc_pieces[["start", "end"]].tolist() == [(0, int(index["token_len"][d]))]


@SETTINGS
@given(corpora, seq_lens)
def test_fast_planner_equals_reference(corpus: list, seq_len: int) -> None:
    index, segments = layout(Conversations.from_lists(corpus))
    fast = plan_shard(index, segments, seq_len)
    slow = plan_shard_reference(index, segments, seq_len)
    np.testing.assert_array_equal(fast.pieces, slow.pieces)
    assert fast.counts == slow.counts


@SETTINGS
@given(corpora, seq_lens)
def test_plan_trains_every_target_exactly_once(corpus: list, seq_len: int) -> None:
    index, segments = layout(Conversations.from_lists(corpus))
    plan = plan_shard(index, segments, seq_len)
    check_plan(index, segments, seq_len, plan.pieces)
    sizes = plan.pieces["end"].astype(np.int64) - plan.pieces["start"]
    assert plan.counts.valid_context_tokens == int(sizes.sum())
    assert plan.counts.padded_tokens == plan.counts.windows * (seq_len + 1) - sizes.sum()
    all_targets = sum(len(target_positions(index, segments, d)) for d in range(len(index)))
    assert plan.counts.assistant_target_tokens == all_targets


@SETTINGS
@given(corpora, seq_lens)
def test_kept_documents_never_start_a_window_inside_a_message(corpus: list, seq_len: int) -> None:
    # What the builder writes: only documents document_drop_reason keeps.
    kept = [
        conv
        for conv in corpus
        if document_drop_reason(layout(Conversations.from_lists([conv]))[1], seq_len) is None
    ]
    index, segments = layout(Conversations.from_lists(kept))
    plan = plan_shard(index, segments, seq_len)
    assert plan.counts.hard_continuations == 0
    first = index["segment_start"].astype(np.int64)
    for piece in plan.pieces:
        doc = int(piece["doc"])
        starts = segments["start"][first[doc] : first[doc] + int(index["segment_count"][doc])]
        assert int(piece["start"]) in starts.tolist()
    check_plan(index, segments, seq_len, plan.pieces)


@SETTINGS
@given(st.lists(messages, min_size=1, max_size=12), seq_lens)
def test_hard_continuation_reason_agrees_with_the_reference_chain(
    conversation: list, seq_len: int
) -> None:
    index, segments = layout(Conversations.from_lists([conversation]))
    reason = document_drop_reason(segments, seq_len)
    reference = plan_shard_reference(index, segments, seq_len)
    has_target = len(target_positions(index, segments, 0)) > 0
    assert (reason == "no_target") == (not has_target)
    assert (reason == "hard_continuation") == (reference.counts.hard_continuations > 0)
    if reason == "message_too_long":
        assert int(segments["length"].max()) > seq_len + 1
