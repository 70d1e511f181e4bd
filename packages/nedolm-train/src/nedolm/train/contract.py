"""What a run promises about its data and recipe, and the refusals that keep resumes honest.

Three fingerprints guard a resume, each over a plain dict that is also stored in the
checkpoint so that a refusal can name exactly what differs:

- dataset: the verified corpus (hashes of the four contract files),
- training contract: everything that changes the optimisation trajectory (seq_len, the
  validation split, the packing policies, the recipe: steps, batch, seed, optimizer, model),
- execution mode: world size, loader workers and the effective compile mode, which change the
  data order or the numerics a resumed run would see; also the parallelism (ddp/fsdp) and the
  elastic flag, recorded but free to change (see ``FREE_ON_RESUME``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from nedolm.data.format import Shard
from nedolm.data.schema import CONTINUATION_POLICY, PACKING_POLICY, TARGET_POLICY
from nedolm.model import ModelConfig

TRAINING_CONTRACT_SCHEMA = "nedolm_sft_training_contract_v2"


FREE_ON_RESUME = ("execution.parallelism", "execution.elastic")
"""Recorded, never refused: checkpoints convert between DDP and FSDP layouts."""
ELASTIC_FREE = ("execution.world_size", "execution.num_workers", "training.recipe.micro_batch_size")
"""What ``train.elastic`` lets a resume change: the loader re-deals the rest of the epoch."""
ELASTIC_HINT = (
    "`train.elastic: true` resumes with another world size, micro_batch_size or num_workers"
)


class ResumeRefused(RuntimeError):
    """A checkpoint was written under a different contract than the current run's."""


def fingerprint(payload: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of ``payload``."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def training_contract(
    dataset_fingerprint: str, seq_len: int, val_shard_ids: Sequence[int], recipe: Mapping
) -> dict[str, Any]:
    """Every setting that can change the optimisation trajectory, as one JSON-ready dict."""
    return {
        "schema": TRAINING_CONTRACT_SCHEMA,
        "dataset_fingerprint": dataset_fingerprint,
        "seq_len": int(seq_len),
        "read_span": int(seq_len) + 1,
        "val_shard_ids": sorted(int(x) for x in val_shard_ids),
        "packing_policy": PACKING_POLICY,
        "target_policy": TARGET_POLICY,
        "continuation_policy": CONTINUATION_POLICY,
        "attention_policy": "eos_plus_row_boundaries_varlen",
        "position_policy": "eos_plus_row_boundaries_reset_rope_to_zero",
        "recipe": json.loads(json.dumps(recipe)),  # tuples -> lists, as a checkpoint holds it
    }


def execution_mode(
    *,
    world_size: int,
    num_workers: int,
    effective_compile: bool,
    parallelism: str = "ddp",
    elastic: bool = False,
) -> dict:
    """The topology and execution settings of a run (see ``FREE_ON_RESUME``)."""
    return {
        "world_size": int(world_size),
        "num_workers": int(num_workers),
        "effective_compile": bool(effective_compile),
        "parallelism": parallelism,
        "elastic": bool(elastic),
    }


def split_train_val(
    shards: Sequence[Shard],
    val_ids: Sequence[int],
    held_out: Sequence[int] = (),
    *,
    train_on_held_out: bool = False,
) -> tuple[list, list]:
    """Partition shards by id into (train, validation); every requested id must exist.

    ``held_out`` are the shards the corpus holds out (its manifest's validation ids): they
    never train, validated or not, unless ``train_on_held_out``.
    """
    wanted = {int(x) for x in val_ids}
    excluded = wanted if train_on_held_out else wanted | {int(x) for x in held_out}
    train = [sh for sh in shards if sh.shard_id not in excluded]
    val = [sh for sh in shards if sh.shard_id in wanted]
    missing = sorted(wanted - {sh.shard_id for sh in val})
    if missing:
        present = sorted(sh.shard_id for sh in shards)
        raise RuntimeError(f"validation shard ids {missing} not found; shard ids: {present}")
    if not train:
        raise RuntimeError(f"validation shard ids {sorted(wanted)} leave no training shard")
    return train, val


def check_plan_matches_audit(stats: Mapping[str, Any], contract: Mapping[str, Any]) -> None:
    """The plan recomputed from the binaries must reproduce the audited counts exactly."""
    pairs = {
        "windows": "training_windows",
        "assistant_target_tokens": "assistant_target_tokens_per_epoch",
        "valid_context_tokens": "valid_context_tokens_per_epoch",
        "padded_tokens": "padded_tokens_per_epoch",
        "turn_aligned_continuations": "turn_aligned_continuations",
        "assistant_aligned_continuations": "assistant_aligned_continuations",
    }
    diffs = [
        f"{key}: recomputed {stats[key]} != audited {contract[audited]}"
        for key, audited in pairs.items()
        if audited in contract and int(stats[key]) != int(contract[audited])
    ]
    if int(stats["hard_continuations"]) != 0:
        diffs.append(f"hard_continuations: recomputed {stats['hard_continuations']} != 0")
    if diffs:
        raise RuntimeError(
            "runtime packing plan differs from the audited contract: " + "; ".join(diffs)
        )


def _differences(saved: Any, current: Any, path: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current), key=str):
            sub = f"{path}.{key}" if path else str(key)
            out += _differences(saved.get(key, "<missing>"), current.get(key, "<missing>"), sub)
        return out
    return (
        [] if saved == current else [f"{path or 'value'}: checkpoint {saved!r} != now {current!r}"]
    )


def _with_new_model_fields(training: Any) -> Any:
    """A training contract whose model config predates a ``ModelConfig`` field (e.g.
    ``tie_embeddings``): the model it trained had that field's default."""
    if not isinstance(training, dict) or not isinstance(training.get("recipe"), dict):
        return training
    recipe = training["recipe"]
    if not isinstance(recipe.get("model_config"), dict):
        return training
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    model_config = {**defaults, **recipe["model_config"]}
    return {**training, "recipe": {**recipe, "model_config": model_config}}


def check_resume(
    checkpoint: Mapping[str, Any],
    current: Mapping[str, Mapping],
    source: str,
    *,
    parts: Sequence[str] = ("dataset", "training", "execution"),
    free: Collection[str] = FREE_ON_RESUME,
    hints: Mapping[str, str] | None = None,
) -> None:
    """Refuse a resume whose dataset, training contract or execution mode changed.

    ``current`` maps each of ``parts`` ("dataset", "training", "execution") to the run's
    contract dict; the checkpoint holds the same dicts under "contract". Keys in ``free``
    (dotted, e.g. ``execution.world_size``) may differ. ``hints`` maps a dotted key to the way
    forward when it differs; the keys ``train.elastic`` frees always name it.

    Raises:
        ResumeRefused: naming the checkpoint and every differing key, e.g.
            ``execution.world_size: checkpoint 2 != now 1``.
    """
    saved = checkpoint.get("contract")
    if not isinstance(saved, dict):
        raise ResumeRefused(f"{source} holds no run contract; resume it with a fresh run_dir")
    problems = []
    for part in parts:
        theirs = _with_new_model_fields(saved.get(part)) if part == "training" else saved.get(part)
        problems += [f"{part}.{d}" for d in _differences(theirs, dict(current[part]))]
    problems = [p for p in problems if p.split(":", 1)[0] not in free]
    ways = {**dict.fromkeys(ELASTIC_FREE, ELASTIC_HINT), **(hints or {})}
    problems = [
        f"{p} ({ways[key]})" if (key := p.split(":", 1)[0]) in ways else p for p in problems
    ]
    if problems:
        raise ResumeRefused(
            f"refusing to resume from {source}: the run changed since it was written: "
            + "; ".join(problems)
            + ". Restore the original settings or start a fresh run_dir."
        )
