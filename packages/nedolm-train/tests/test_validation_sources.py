"""Validation per source (a corpus built with validation inputs): each input's loss and target
count over a pass equal those of a plain pass over that input's shard alone, and the overall
figures are their target-weighted whole (in-process, real corpus and model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nedolm.data.contract import read_validation_sources
from nedolm.data.format import read_special_tokens
from nedolm.data.loader import build_sft_loader
from nedolm.data.packing import discover_sft_shards
from nedolm.dist import DistInfo
from nedolm.model import build_model, preset
from nedolm.train.step import LossOptions, StepError
from nedolm.train.testing import SMALL_BASE, OpNames
from nedolm.train.validation import run_validation

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
FUSED = LossOptions(assistant_only_head=True, loss_fp32_logits=True, use_amp=False)
FULL_LOGITS = LossOptions(assistant_only_head=False, loss_fp32_logits=True, use_amp=False)
SEQ_LEN = 256


@pytest.fixture
def corpus(val_inputs_corpus: Path) -> Path:
    """This module's corpus: the conftest's with two validation inputs (shards 2 and 3)."""
    return val_inputs_corpus


@pytest.mark.parametrize("options", [FUSED, FULL_LOGITS], ids=["fused_head", "full_logits"])
def test_each_source_validates_as_its_shard_alone(corpus: Path, options: LossOptions) -> None:
    sources = read_validation_sources(corpus)
    assert sources == {2: "tquad_enelpi_train.jsonl", 3: "seed_tasks_tr.jsonl"}
    special = read_special_tokens(corpus)
    torch.manual_seed(0)
    model = build_model(preset("tiny", **{**SMALL_BASE, "vocab_size": special.vocab_size}))
    shards = {s.shard_id: s for s in discover_sft_shards(corpus, SEQ_LEN)}

    def validate(ids: list[int], **kwargs: object):
        """A pass over every window of the shards ``ids`` exactly once, 4 rows a batch (the
        batches of both shards mix their rows)."""
        planned = [shards[i] for i in ids]
        loader, _ = build_sft_loader(corpus, SEQ_LEN, micro_batch_size=4, shards=planned, seed=5)
        windows = sum(s.plan.counts.windows for s in planned)
        assert windows % 4 == 0
        return run_validation(
            model,
            loader,
            CPU,
            batches=windows // 4,
            eos_id=special.eos_id,
            options=options,
            **kwargs,
        )

    both = validate([2, 3], sources=sources)
    for shard, name in sources.items():
        alone = validate([shard])
        assert alone.loss_by_source == {}  # no sources given: the overall figures only
        assert both.targets_by_source[name] == alone.targets
        assert alone.targets == shards[shard].plan.counts.assistant_target_tokens
        assert both.loss_by_source[name] == pytest.approx(alone.loss, rel=1e-6)
    assert both.targets == sum(both.targets_by_source.values())
    weighted = sum(both.loss_by_source[n] * both.targets_by_source[n] for n in sources.values())
    assert both.loss == pytest.approx(weighted / both.targets, rel=1e-9)


def test_a_non_finite_validation_loss_is_refused(corpus: Path) -> None:
    """Checked once, on the summed totals every rank reads (no read of the device per batch):
    one NaN weight makes the pass non-finite, refused with the sum found."""
    special = read_special_tokens(corpus)
    model = build_model(preset("tiny", **{**SMALL_BASE, "vocab_size": special.vocab_size}))
    with torch.no_grad():
        model.norm.weight[0] = float("nan")
    shard = next(s for s in discover_sft_shards(corpus, SEQ_LEN) if s.shard_id == 2)
    loader, _ = build_sft_loader(corpus, SEQ_LEN, micro_batch_size=4, shards=[shard], seed=5)
    with pytest.raises(StepError, match=r"non-finite validation loss \(nan\)"):
        run_validation(model, loader, CPU, batches=1, eos_id=special.eos_id, options=FUSED)


@pytest.mark.parametrize("per_source", [False, True], ids=["overall", "per_source"])
def test_validation_reads_the_device_once_per_pass_not_per_batch(
    corpus: Path, per_source: bool
) -> None:
    special = read_special_tokens(corpus)
    model = build_model(preset("tiny", **{**SMALL_BASE, "vocab_size": special.vocab_size}))
    shards = [s for s in discover_sft_shards(corpus, SEQ_LEN) if s.shard_id in (2, 3)]
    sources = read_validation_sources(corpus) if per_source else None

    def host_reads(batches: int) -> int:
        loader, _ = build_sft_loader(corpus, SEQ_LEN, micro_batch_size=4, shards=shards, seed=5)
        with (ops := OpNames()):
            run_validation(
                model,
                loader,
                CPU,
                batches=batches,
                eos_id=special.eos_id,
                options=FUSED,
                sources=sources,
            )
        return ops.names.count("_local_scalar_dense")

    host_reads(1)  # first calls build what later ones reuse
    assert host_reads(4) == host_reads(2) <= 1
