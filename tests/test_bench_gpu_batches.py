"""``bench/trainer_gpu.py`` divides the trainer's tokens/s by the model step's on "the same real
micro-batches": they must be the very micro-batches the trainer's run starts with (its training
shards, not the held-out one; its seed), or the ratio compares two different draws."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from nedolm.dist import get_info
from nedolm.train.config import load_sft_config
from nedolm.train.setup import prepare_run
from nedolm.train.step import to_micro_batch


@pytest.mark.slow
def test_the_model_step_is_timed_on_the_trainers_own_micro_batches(trainer_gpu, tmp_path: Path):
    plan = trainer_gpu.plan_for(argparse.Namespace(smoke=True, data=[]))
    corpus, base = trainer_gpu.prepare(plan, tmp_path)  # 4 shards, shard 3 held out
    config = trainer_gpu.write_config(tmp_path / "sft.yaml", plan, corpus, base)
    steps, eos = trainer_gpu.real_optimizer_steps(plan, config, 3)
    bench = [mb for step in steps for mb in step]
    assert len(bench) == 3 * plan.grad_accum

    cfg = load_sft_config(config)
    cfg.run_dir.mkdir()
    run = prepare_run(cfg, get_info(), allow_compile=False)
    device = torch.device(plan.device)
    trainer = [to_micro_batch(next(run.train_batches), device, eos) for _ in bench]
    for i, (ours, theirs) in enumerate(zip(bench, trainer, strict=True)):
        assert torch.equal(ours.inputs, theirs.inputs), f"micro-batch {i}"
        assert torch.equal(ours.labels, theirs.labels), f"micro-batch {i}"
        assert ours.targets == theirs.targets
