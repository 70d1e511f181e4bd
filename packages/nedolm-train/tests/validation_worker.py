"""One rank of a per-source validation pass: ``python validation_worker.py OUT_DIR MODE CORPUS``.

``CORPUS`` has two validation inputs (shards 2 and 3). The ranks validate different rows, as
ranks do: rank 0 batches mix both shards, rank 1 reads shard 2 alone. Each rank writes
``rank{R}.json``: the model's forward calls during the pass; rank 0 also ``result.json``, the
pass's figures. Run under ``MODE`` ddp (validation runs the bare replica) and fsdp (every
forward all-gathers the sharded blocks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from nedolm.data.contract import read_validation_sources
from nedolm.data.format import read_special_tokens
from nedolm.data.loader import build_sft_loader
from nedolm.data.packing import discover_sft_shards
from nedolm.dist import DistInfo, cleanup, setup_distributed
from nedolm.model import MorphTransformer, build_model, preset
from nedolm.train.parallel import parallelize, unwrap
from nedolm.train.step import LossOptions
from nedolm.train.testing import SMALL_BASE
from nedolm.train.validation import ValidationResult, run_validation

SEQ_LEN = 256
ROWS = 4
SHARDS_OF_RANK = ([2, 3], [2])
OPTIONS = LossOptions(assistant_only_head=True, loss_fp32_logits=True, use_amp=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("mode", choices=["ddp", "fsdp"])
    parser.add_argument("corpus", type=Path)
    args = parser.parse_args()
    info = setup_distributed(backend="gloo")
    model = tiny_model(args.corpus)
    bare = unwrap(parallelize(model, args.mode, device=info.device, compute="fp32"))
    forwards = 0

    def count(*_: object) -> None:
        nonlocal forwards
        forwards += 1

    bare.register_forward_pre_hook(count)
    result = validate(bare, args.corpus, SHARDS_OF_RANK[info.rank], info)
    (args.out_dir / f"rank{info.rank}.json").write_text(json.dumps({"forwards": forwards}))
    if info.is_main:
        (args.out_dir / "result.json").write_text(json.dumps(dataclasses.asdict(result)))
    cleanup()


def tiny_model(corpus: Path) -> MorphTransformer:
    """The same weights on every rank and in the test's own passes."""
    torch.manual_seed(0)
    vocab_size = read_special_tokens(corpus).vocab_size
    return build_model(preset("tiny", **{**SMALL_BASE, "vocab_size": vocab_size}))


def batches(corpus: Path) -> int:
    """The pass's batch count on every rank: as many as shard 2 alone fills."""
    shard = next(s for s in discover_sft_shards(corpus, SEQ_LEN) if s.shard_id == 2)
    return shard.plan.counts.windows // ROWS


def validate(
    model: torch.nn.Module, corpus: Path, shard_ids: list[int], info: DistInfo
) -> ValidationResult:
    """``model``'s per-source validation pass over the first windows of ``shard_ids``."""
    shards = {s.shard_id: s for s in discover_sft_shards(corpus, SEQ_LEN)}
    loader, _ = build_sft_loader(
        corpus, SEQ_LEN, micro_batch_size=ROWS, shards=[shards[i] for i in shard_ids], seed=5
    )
    return run_validation(
        model,
        loader,
        info,
        batches=batches(corpus),
        eos_id=read_special_tokens(corpus).eos_id,
        options=OPTIONS,
        sources=read_validation_sources(corpus),
    )


if __name__ == "__main__":
    main()
