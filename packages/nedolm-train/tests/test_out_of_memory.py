"""An allocation failure is named as one, with the run's own keys that make the step fit.

The end-to-end tests make the failure real: the trainer runs in a process whose data segment
is capped (RLIMIT_DATA), and the full-logits reference head of 256 x 256-token micro-batches asks
torch's CPU allocator for 8.4 GB at once (the tiny model, its data and every other buffer fit
in the cap). A CUDA OOM takes the same paths: ``torch.OutOfMemoryError`` is recognised by type.
"""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import torch

from nedolm.train.config import SFTConfig, TrainConfig, ValidationConfig
from nedolm.train.memory import CPU_ALLOCATOR_FAILURE, is_out_of_memory, memory_advice

DATA_BYTES = 5 * 2**30
"""Room for the tiny trainer's heap (under 1 GiB at start, with a CUDA build of torch too), not
for 256 x 256 x 32k float32 logits. RLIMIT_DATA, not RLIMIT_AS: a CUDA build maps 5 GB of
libraries at import, which count in the address space but not in the data segment."""
HUGE_MICRO_BATCH = {"micro_batch_size": 256, "grad_accum_steps": 1, "max_steps": 1}
FULL_LOGITS = {"assistant_only_head": False}


def _config(**train: object) -> SFTConfig:
    return SFTConfig(
        run_dir=Path("run"),
        data_dir=Path("corpus"),
        base_hf_dir=Path("hf"),
        train=TrainConfig(**train),  # type: ignore[arg-type]
        validation=ValidationConfig(),
    )


def test_allocation_failures_are_recognised_through_wrappers() -> None:
    with pytest.raises(RuntimeError) as cpu:
        torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: more than any address space
    assert CPU_ALLOCATOR_FAILURE in str(cpu.value)
    assert is_out_of_memory(cpu.value)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_out_of_memory(MemoryError())
    try:  # compiled code re-raises the allocator's error as its cause
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError as exc:
            raise RuntimeError("backend compiler failed") from exc
    except RuntimeError as wrapped:
        assert is_out_of_memory(wrapped)
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("bad value"))


def test_the_advice_names_only_keys_that_would_shrink_the_step() -> None:
    first = memory_advice(_config(micro_batch_size=6, grad_accum_steps=2), 4096, 1)
    assert first.train == (
        "micro-batches of 6 x 4096 tokens; to fit, lower train.micro_batch_size (e.g. 3 with "
        "train.grad_accum_steps 4: the same 12 windows per step on each rank); set "
        "train.grad_checkpoint: true (blocks recompute activations); prepare the corpus at a "
        "shorter --seq-len (now 4096)"
    )
    assert first.validation == (
        "micro-batches of 6 x 4096 tokens; to fit, lower validation.micro_batch_size (now 6); "
        "prepare the corpus at a shorter --seq-len (now 4096)"
    )
    last = memory_advice(_config(micro_batch_size=1, grad_checkpoint=True), 2048, 1)
    assert last.train == (
        "micro-batches of 1 x 2048 tokens; to fit, prepare the corpus at a shorter --seq-len "
        "(now 2048)"
    )
    many = memory_advice(_config(micro_batch_size=1, grad_checkpoint=True), 2048, 8)
    assert many.train.endswith(
        "to fit, set train.parallelism: fsdp (weights, gradients and AdamW's moments sharded "
        "over the 8 ranks); prepare the corpus at a shorter --seq-len (now 2048)"
    )
    sharded = memory_advice(_config(grad_checkpoint=True, parallelism="fsdp"), 2048, 8)
    assert "parallelism" not in sharded.train
    logits = memory_advice(_config(**FULL_LOGITS), 512, 1)
    for advice in (logits.train, logits.validation):
        assert "; to fit, set train.assistant_only_head: true (the fused head" in advice


def _cap() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (DATA_BYTES, DATA_BYTES))


CAPPED = {0: _cap}


def _failure(output: str) -> str:
    lines = [line for line in output.splitlines() if "OutOfMemory: out of memory" in line]
    assert lines, output[-3000:]
    assert CPU_ALLOCATOR_FAILURE in lines[-1]  # torch's own message is kept
    return lines[-1]


@pytest.mark.slow
def test_a_warm_up_that_does_not_fit_is_not_called_a_backend_failure(harness, make_config) -> None:
    config = make_config(train={**HUGE_MICRO_BATCH, **FULL_LOGITS, "compile": True})
    job = harness.Job(config, before_exec=CAPPED)
    assert job.wait() == [1]
    output = job.output()
    assert (
        "out of memory in the compile warm-up: micro-batches of 256 x 256 tokens; to fit, set "
        "train.assistant_only_head: true"
    ) in _failure(output)
    assert "attention backend" not in output and "torch.compile disabled" not in output
    assert not list((job.run_dir / "checkpoints").glob("*"))


@pytest.mark.slow
def test_every_rank_stops_with_every_rank_s_failure(harness, make_config) -> None:
    config = make_config(train={**HUGE_MICRO_BATCH, **FULL_LOGITS, "compile": True})
    job = harness.Job(config, world_size=2, before_exec={0: _cap, 1: _cap})
    assert job.wait() == [1, 1]
    for rank in (0, 1):
        failure = _failure(job.output(rank))
        assert "out of memory in the compile warm-up: micro-batches of 256 x 256" in failure
        assert "set train.parallelism: fsdp (weights, gradients and AdamW's moments" in failure
        assert "rank 0: RuntimeError:" in failure and " | rank 1: RuntimeError:" in failure


@pytest.mark.slow
def test_validation_and_a_step_that_do_not_fit_name_their_own_keys(harness, make_config) -> None:
    config = make_config("validation", train={**HUGE_MICRO_BATCH, **FULL_LOGITS})
    job = harness.Job(config, before_exec=CAPPED)
    assert job.wait() == [1]
    failure = _failure(job.output())
    assert "out of memory in validation: micro-batches of 256 x 256 tokens" in failure
    assert "lower validation.micro_batch_size (now 256)" in failure
    assert "train.micro_batch_size" not in failure

    config = make_config(
        "step", train={**HUGE_MICRO_BATCH, **FULL_LOGITS}, validation={"micro_batch_size": 1}
    )
    job = harness.Job(config, before_exec=CAPPED)
    assert job.wait() == [1]
    output = job.output()
    failure = _failure(output)
    assert "out of memory at optimizer step 0: micro-batches of 256 x 256 tokens" in failure
    assert "lower train.micro_batch_size (e.g. 128 with train.grad_accum_steps 2" in failure
    assert "validation at step 0: loss" in output  # validation fitted; the step did not
