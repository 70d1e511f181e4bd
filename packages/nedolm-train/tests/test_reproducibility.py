"""Bitwise reproducibility on CPU, eager and compiled, with more than one thread: two
uninterrupted runs of one recipe and a resume from the middle of one of them end on the same
weights and losses (real processes; inductor for the compiled runs).

Two threads because that is where compiled runs used to differ: inductor's CPU kernel for the
embedding's backward added into rows from several threads at once (max |dw| ~1e-8 after 3
steps, 2.7e-7 on longer runs) until the trainer turned on torch's deterministic algorithms.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nedolm.train.testing import init_tiny_base

pytestmark = pytest.mark.slow
STEPS, SAVE_AT = 4, 2
THREADS = {"OMP_NUM_THREADS": "2"}
SMALLEST = {"d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 64}
"""A smaller model than the shared base: inductor compiles it in a minute, not several."""
RUN_TIMEOUT_S = 900  # a compile on a loaded 2-core machine; no timing is asserted


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, corpus: Path, harness) -> Path:
    out = tmp_path_factory.mktemp("base") / "base"
    return init_tiny_base(out, corpus, {**SMALLEST, "max_seq_len": harness.SEQ_LEN}, seed=1)


def three_runs(harness, corpus: Path, base: Path, root: Path, env: dict, **train) -> list[Path]:
    """Run dirs of: the recipe, the recipe again, and a resume from the first one's SAVE_AT."""
    train = {"max_steps": STEPS, "ckpt_interval": SAVE_AT, "keep_last": 5, **train}
    dirs = []
    for run in ("a", "b", "resumed"):
        config = harness.write_config(root / f"{run}.yaml", corpus, base, root / run, train=train)
        if run == "resumed":
            harness.copy_checkpoint(dirs[0], SAVE_AT, into=root / run)
        job = harness.Job(config, env=env)
        job.wait_ok(timeout=RUN_TIMEOUT_S)
        dirs.append(job.run_dir)
    assert "resuming from" in (dirs[2] / "train.log").read_text(encoding="utf-8")
    return dirs


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def assert_bitwise_alike(harness, dirs: list[Path], label: str) -> None:
    first, *others = dirs
    losses = harness.step_losses(first)
    assert sorted(losses) == list(range(1, STEPS + 1))
    weights = harness.final_weights(first)
    for other in others:
        spread = max_abs_diff(weights, harness.final_weights(other))
        print(f"{label}: max |dw| {first.name} vs {other.name} = {spread:.3g}")
        harness.assert_same_weights(weights, harness.final_weights(other))
        theirs = harness.step_losses(other)
        assert theirs == {step: losses[step] for step in theirs}


def test_eager_cpu_runs_and_a_resume_are_bitwise_equal(
    harness, corpus: Path, base: Path, tmp_path: Path
) -> None:
    dirs = three_runs(harness, corpus, base, tmp_path, THREADS, compile=False)
    assert_bitwise_alike(harness, dirs, "eager")


def test_compiled_cpu_runs_and_a_resume_are_bitwise_equal(
    harness, corpus: Path, base: Path, tmp_path: Path
) -> None:
    # One inductor cache for the three runs: the later ones load the first one's kernels
    # (much faster); what differed was the order of the kernels' atomic adds at run time.
    env = {**THREADS, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    dirs = three_runs(
        harness, corpus, base, tmp_path, env, compile=True, compile_backend="inductor"
    )
    for run_dir in dirs:
        assert "compile warm-up done" in (run_dir / "train.log").read_text(encoding="utf-8")
    assert_bitwise_alike(harness, dirs, "compiled")
