"""``TrainState`` checkpoints: format version 1 (written by the old trainer) resumes to float32
rounding; an unknown format version is refused by name."""

from __future__ import annotations

import pytest
import torch

from nedolm.train.checkpoint import load_checkpoint
from nedolm.train.state import CHECKPOINT_FORMAT_VERSION, CheckpointFormatError, upgrade_checkpoint

LEGACY_RTOL = 1e-6
"""How far the old trainer's losses may be from today's (measured: 2e-8 relative)."""
LEGACY_WEIGHT_ATOL = 3e-5


@pytest.mark.slow
def test_format_1_checkpoint_of_the_old_trainer_resumes_to_float32_rounding(
    harness, unclipped_reference, legacy_run, make_config
) -> None:
    """Both runs train unclipped: the old trainer clipped by a float32 norm (see UNCLIPPED).

    The old and today's trainer agree to float32 rounding, not bitwise: today's fused loss head
    takes its log-sum-exp in place over half-size chunks (other summation orders, ~2e-8
    relative). A resume that lost the optimizer moments or the loader cursor would be off by
    orders of magnitude more than LEGACY_RTOL.
    """
    step = harness.EPOCH_STEPS
    legacy = load_checkpoint(legacy_run / "checkpoints" / f"step-{step:08d}.pt")
    assert "format_version" not in legacy and "data_state" in legacy["ranks"][0]
    expected = harness.step_losses(unclipped_reference)
    old = harness.step_losses(legacy_run)
    assert old == pytest.approx(expected, rel=LEGACY_RTOL, abs=0)
    upgraded = upgrade_checkpoint(legacy, "legacy.pt")
    assert upgraded["format_version"] == CHECKPOINT_FORMAT_VERSION
    (cursor,) = upgraded["ranks"][0]["loader"].values()
    assert (cursor[1], cursor[2]) == (1, 0)  # epoch 1, cursor 0

    # The old trainer wrote no digest: resuming from its checkpoint takes trust_unverified.
    config = make_config(optim=harness.UNCLIPPED, train={"trust_unverified": True})
    run_dir = config.with_suffix("")
    harness.copy_checkpoint(legacy_run, step, into=run_dir)
    harness.Job(config).wait_ok()
    log = (run_dir / "train.log").read_text(encoding="utf-8")
    assert "unverified: it carries no digest (--trust-unverified)" in log
    losses = harness.step_losses(run_dir)
    assert sorted(losses) == list(range(step + 1, harness.MAX_STEPS + 1))
    assert losses == pytest.approx({s: expected[s] for s in losses}, rel=LEGACY_RTOL, abs=0)
    resumed, reference = (harness.final_weights(d) for d in (run_dir, unclipped_reference))
    assert resumed.keys() == reference.keys()
    for key in resumed:
        # AdamW normalises each update: a weight whose gradient is ~0 moves by its rounding
        # noise (3e-6 measured), while a lost moment or cursor moves weights by ~lr (3e-3).
        torch.testing.assert_close(resumed[key], reference[key], rtol=0, atol=LEGACY_WEIGHT_ATOL)
    written = load_checkpoint(run_dir / "checkpoints" / f"step-{harness.MAX_STEPS:08d}.pt")
    assert written["format_version"] == CHECKPOINT_FORMAT_VERSION


def test_unknown_format_version_is_refused_by_name() -> None:
    with pytest.raises(
        CheckpointFormatError,
        match=r"ck\.pt has checkpoint format version 7; this trainer reads version 2 "
        r"and converts version 1",
    ):
        upgrade_checkpoint({"format_version": 7, "model": {}}, "ck.pt")
    with pytest.raises(CheckpointFormatError, match=r"ck\.pt has no format_version and is not"):
        upgrade_checkpoint({"model": {}, "step": 3}, "ck.pt")
