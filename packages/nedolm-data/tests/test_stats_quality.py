"""corpus_stats, validate_roles and the packing quality report against token-by-token counts."""

from pathlib import Path

import numpy as np
import pytest

from nedolm.data.format import Shard, discover_shards, shard_file_name, write_array
from nedolm.data.packing import PackingCounts, discover_sft_shards
from nedolm.data.records import ROLE_ASSISTANT, ROLE_USER
from nedolm.data.roles import RoleError, validate_roles
from nedolm.data.stats import corpus_stats, packing_quality
from nedolm.data.synthetic import random_conversations, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(7)
    data_dir = tmp_path_factory.mktemp("corpus")
    write_corpus(data_dir, [random_conversations(rng, 40, 25) for _ in range(3)])
    return data_dir


def document_targets(shard: Shard, doc: int) -> list[int]:
    first, count = int(shard.index["segment_start"][doc]), int(shard.index["segment_count"][doc])
    return [
        p
        for m in shard.segments[first : first + count]
        if m["trainable"]
        for p in range(int(m["start"] + m["header_len"]), int(m["start"] + m["length"]))
    ]


@pytest.mark.parametrize("seq_len", [16, 63, 200])
def test_packing_quality_matches_token_counts(corpus: Path, seq_len: int) -> None:
    shards = discover_sft_shards(corpus, seq_len)
    report = packing_quality(shards, seq_len)
    row = seq_len + 1
    truncate_lost = concat_rows = concat_valid = cross = split = targets = 0
    for s in shards:
        index = s.shard.index
        lengths = index["token_len"].astype(int).tolist()
        # (document, position) of every token of the shard, concatenated.
        owner = [(d, p) for d, n in enumerate(lengths) for p in range(n)]
        is_target = set()
        for d in range(len(lengths)):
            doc_targets = document_targets(s.shard, d)
            targets += len(doc_targets)
            truncate_lost += sum(p >= row for p in doc_targets)
            is_target |= {(d, p) for p in doc_targets}
        chunks = []
        while len(chunks) * seq_len < len(owner) - 1:  # every row has at least one label
            chunks.append(owner[len(chunks) * seq_len :][:row])
        for chunk in chunks:
            concat_valid += len(chunk)
            # A label attends to another conversation when its row starts in another document.
            cross += sum(t in is_target and t[0] != chunk[0][0] for t in chunk[1:])
        for d, n in enumerate(lengths):
            split += not any({(d, p) for p in range(n)} <= set(chunk) for chunk in chunks)
        concat_rows += len(chunks)
    counts = sum((s.plan.counts for s in shards), PackingCounts())

    adaptive = report["adaptive"]
    assert adaptive["rows"] == counts.windows
    assert adaptive["targets"] == targets == counts.assistant_target_tokens
    assert adaptive["targets_lost"] == 0
    assert adaptive["valid_context_ratio"] == counts.valid_context_tokens / (counts.windows * row)
    assert report["truncate"]["targets_lost"] == truncate_lost
    assert report["truncate"]["rows"] == sum(len(s.shard.index) for s in shards)
    concat = report["concat_chunk"]
    assert (concat["rows"], concat["valid_context_tokens"]) == (concat_rows, concat_valid)
    assert concat["targets_lost"] == 0
    assert concat["cross_document_targets"] == cross
    assert concat["split_documents"] == split
    for figures in (adaptive, report["truncate"], concat):
        assert figures["padded_tokens"] == figures["rows"] * row - figures["valid_context_tokens"]


def test_corpus_stats_sums_the_plans(corpus: Path) -> None:
    shards = discover_sft_shards(corpus, 32)
    stats = corpus_stats(shards, 32)
    counts = sum((s.plan.counts for s in shards), PackingCounts())
    assert stats["shards"] == 3
    assert stats["windows"] == counts.windows
    assert stats["raw_tokens"] == sum(int(s.shard.tokens.size) for s in shards)
    assert stats["assistant_target_ratio"] == counts.assistant_target_tokens / (counts.windows * 33)
    assert stats["hard_continuations"] == counts.hard_continuations
    with pytest.raises(ValueError, match="planned for seq_len 32, not 64"):
        corpus_stats(shards, 64)


def test_validate_roles_counts_and_refuses_bad_records(corpus: Path, tmp_path: Path) -> None:
    shards = discover_sft_shards(corpus, 32)
    roles = validate_roles(shards)
    segments = np.concatenate([s.shard.segments for s in shards])
    assert roles["user"] == int((segments["role"] == ROLE_USER).sum())
    assistant = segments["role"] == ROLE_ASSISTANT
    assert roles["assistant"] == roles["assistant_trainable"] + roles["assistant_context"]
    assert roles["assistant_context"] == int((assistant & (segments["trainable"] == 0)).sum())

    write_corpus(tmp_path, [random_conversations(np.random.default_rng(1), 5, 10)])
    (shard,) = discover_shards(tmp_path)
    path = tmp_path / "shards" / shard_file_name(0, 1, "segments")
    bad = np.array(shard.segments)
    bad["role"][3] = 7
    write_array(path, "segments", bad)
    with pytest.raises(RoleError, match=r"segments\.bin: record 3 has unknown role code 7"):
        validate_roles(discover_sft_shards(tmp_path, 32))
    bad["role"][3] = ROLE_USER
    bad["trainable"][3] = 1
    write_array(path, "segments", bad)
    with pytest.raises(RoleError, match="record 3 is a trainable user message"):
        validate_roles(discover_sft_shards(tmp_path, 32))
