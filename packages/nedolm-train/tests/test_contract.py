"""Contract helpers on plain values: what a refusal names."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from nedolm.data.format import Shard
from nedolm.model import ModelConfig
from nedolm.train.contract import (
    ResumeRefused,
    check_plan_matches_audit,
    check_resume,
    fingerprint,
    split_train_val,
)


def _shards(*ids: int) -> list[Shard]:
    return [Shard.in_dir(Path("/nowhere"), i, 8) for i in ids]


def test_split_by_shard_id_and_its_errors() -> None:
    train, val = split_train_val(_shards(0, 1, 2, 3), [2])
    assert [s.shard_id for s in train] == [0, 1, 3] and [s.shard_id for s in val] == [2]
    with pytest.raises(
        RuntimeError, match=r"validation shard ids \[7\] not found; shard ids: \[0, 1\]"
    ):
        split_train_val(_shards(0, 1), [7])
    with pytest.raises(RuntimeError, match="leave no training shard"):
        split_train_val(_shards(0, 1), [0, 1])


def test_the_corpus_held_out_shards_never_train_unless_allowed() -> None:
    """Issue 15 bug 2: validation disabled (no ids) or other ids must not train shard 3."""
    shards = _shards(0, 1, 2, 3)
    for val_ids in ([], [1]):
        train, val = split_train_val(shards, val_ids, held_out=[3])
        assert 3 not in [s.shard_id for s in train]
        assert [s.shard_id for s in val] == val_ids
    train, _ = split_train_val(shards, [], held_out=[3], train_on_held_out=True)
    assert [s.shard_id for s in train] == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="leave no training shard"):
        split_train_val(_shards(0, 1), [0], held_out=[1])


def test_plan_check_names_every_differing_count() -> None:
    stats = {
        "windows": 10,
        "assistant_target_tokens": 50,
        "valid_context_tokens": 90,
        "padded_tokens": 5,
        "turn_aligned_continuations": 0,
        "assistant_aligned_continuations": 1,
        "hard_continuations": 2,
    }
    audit = {"training_windows": 11, "assistant_target_tokens_per_epoch": 50}
    with pytest.raises(RuntimeError) as err:
        check_plan_matches_audit(stats, audit)
    assert "windows: recomputed 10 != audited 11" in str(err.value)
    assert "hard_continuations: recomputed 2 != 0" in str(err.value)
    assert "assistant_target_tokens" not in str(err.value)


def test_resume_check_names_nested_keys_and_legacy_checkpoints() -> None:
    current = {"training": {"recipe": {"optim": {"lr": 1.0}, "seed": 1}}, "execution": {"w": 2}}
    saved = {
        "contract": {
            "training": {"recipe": {"optim": {"lr": 2.0}, "seed": 1}},
            "execution": {"w": 2},
        }
    }
    with pytest.raises(
        ResumeRefused, match=r"training\.recipe\.optim\.lr: checkpoint 2\.0 != now 1\.0"
    ):
        check_resume(saved, current, "ck.pt", parts=("training", "execution"))
    check_resume(saved, current, "ck.pt", parts=("execution",))
    with pytest.raises(ResumeRefused, match=r"ck\.pt holds no run contract"):
        check_resume({"model": {}}, current, "ck.pt")


def test_a_model_field_added_since_the_checkpoint_counts_as_its_default() -> None:
    model = dataclasses.asdict(ModelConfig())
    older = {k: v for k, v in model.items() if k not in ("tie_embeddings", "rope_scaling")}
    saved = {"contract": {"training": {"recipe": {"model_config": older}}}}
    check_resume(
        saved, {"training": {"recipe": {"model_config": model}}}, "ck.pt", parts=("training",)
    )
    untied = {"training": {"recipe": {"model_config": {**model, "tie_embeddings": False}}}}
    with pytest.raises(
        ResumeRefused,
        match=r"model_config\.tie_embeddings: checkpoint True != now False",
    ):
        check_resume(saved, untied, "ck.pt", parts=("training",))


def test_fingerprint_is_canonical() -> None:
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
