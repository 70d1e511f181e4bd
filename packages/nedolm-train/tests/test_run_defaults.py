"""Defaults that fit the corpus and the run, and refusals that say the way forward, through the
real ``run()`` in this process: train.seq_len comes from the corpus, warm-up may be a fraction
and is warned about when it fills the run, and a refused resume names the setting that allows
it (``train.elastic``) or the ``--set`` that continues an extended run."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from nedolm.dist import RankError
from nedolm.train.checkpoint import latest_checkpoint, load_checkpoint
from nedolm.train.config import load_sft_config
from nedolm.train.metrics import read_metrics
from nedolm.train.optim import lr_at_step
from nedolm.train.testing import init_tiny_base
from nedolm.train.trainer import run

ONE_STEP = {"max_steps": 1}
NO_VALIDATION = {"enabled": False}


def _run(config: Path, *overrides: str) -> None:
    run(load_sft_config(config, overrides), compile=False)


def _base(harness, tmp_path: Path, corpus: Path, max_seq_len: int) -> Path:
    tiny = {**harness.TINY, "max_seq_len": max_seq_len}
    return init_tiny_base(tmp_path / f"base-{max_seq_len}", corpus, tiny, seed=1)


def _config(harness, tmp_path: Path, corpus: Path, base: Path, **sections) -> Path:
    sections = {"validation": NO_VALIDATION, **sections}
    return harness.write_config(tmp_path / "run.yaml", corpus, base, tmp_path / "run", **sections)


def stored_optim(run_dir: Path) -> dict:
    """The optimizer recipe the newest checkpoint's contract holds."""
    state = load_checkpoint(latest_checkpoint(run_dir))
    return state["contract"]["training"]["recipe"]["optim"]


def test_seq_len_defaults_to_the_corpus_s_not_the_model_s(harness, tmp_path, corpus) -> None:
    base = _base(harness, tmp_path, corpus, max_seq_len=2 * harness.SEQ_LEN)
    _run(_config(harness, tmp_path, corpus, base, train={**ONE_STEP, "seq_len": None}))
    resolved = json.loads((tmp_path / "run" / "config.resolved.json").read_text())
    assert resolved["seq_len"] == harness.SEQ_LEN
    assert resolved["contract"]["training"]["seq_len"] == harness.SEQ_LEN


@pytest.mark.parametrize(
    ("model_max", "seq_len", "needle"),
    [
        (
            256,
            128,
            "train.seq_len=128 but the corpus {corpus} was prepared at seq_len=256: drop "
            "train.seq_len (it defaults to the corpus's) or prepare the corpus again with "
            "--seq-len 128",
        ),
        (
            128,
            None,
            "train.seq_len=256 exceeds the model's max_seq_len=128: prepare the corpus again "
            "with --seq-len 128 or less",
        ),
        (
            256,
            512,
            "train.seq_len=512 exceeds the model's max_seq_len=256: drop train.seq_len to train "
            "at the corpus's seq_len=256",
        ),
    ],
)
def test_a_seq_len_that_cannot_train_says_what_to_change(
    harness, tmp_path, corpus, model_max, seq_len, needle
) -> None:
    base = _base(harness, tmp_path, corpus, max_seq_len=model_max)
    config = _config(harness, tmp_path, corpus, base, train={**ONE_STEP, "seq_len": seq_len})
    with pytest.raises(RankError) as err:
        _run(config)
    assert needle.format(corpus=corpus) in str(err.value)


def test_warmup_ratio_is_a_fraction_of_the_run(harness, tmp_path, corpus, base_run) -> None:
    optim = {"warmup_steps": None, "warmup_ratio": 0.5}
    config = _config(harness, tmp_path, corpus, base_run, optim=optim, train={"max_steps": 4})
    _run(config)
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    cfg = load_sft_config(config).optim
    as_steps = msgspec.structs.replace(cfg, warmup_ratio=None, warmup_steps=2)  # ceil(0.5 * 4)
    assert lrs == [lr_at_step(step, as_steps, 4) for step in range(4)]
    assert lrs[0] == pytest.approx(as_steps.lr / 2) and lrs[1] == pytest.approx(as_steps.lr)
    assert "warm-up of" not in (tmp_path / "run" / "train.log").read_text()
    assert stored_optim(tmp_path / "run")["warmup_ratio"] == 0.5


def test_a_warm_up_as_long_as_the_run_is_warned_about(harness, tmp_path, corpus, base_run) -> None:
    optim = {"warmup_steps": 3}
    _run(_config(harness, tmp_path, corpus, base_run, optim=optim, train={"max_steps": 2}))
    assert (
        "WARNING warm-up of 3 steps is as long as the run (2 steps): the lr never leaves the "
        "warm-up ramp; lower optim.warmup_steps or give optim.warmup_ratio"
    ) in (tmp_path / "run" / "train.log").read_text()
    stored = stored_optim(tmp_path / "run")  # as every version before warmup_ratio stored it,
    assert "warmup_ratio" not in stored and stored["warmup_steps"] == 3  # so their runs resume


@pytest.mark.parametrize(
    ("override", "difference"),
    [
        ("train.micro_batch_size=2", "training.recipe.micro_batch_size: checkpoint 1 != now 2"),
        ("train.num_workers=1", "execution.num_workers: checkpoint 0 != now 1"),
    ],
)
def test_a_resume_with_another_batch_or_worker_count_names_train_elastic(
    harness, tmp_path, corpus, base_run, override, difference
) -> None:
    config = _config(harness, tmp_path, corpus, base_run, train={"max_steps": 1})
    _run(config)
    with pytest.raises(RankError) as err:
        _run(config, override)
    assert (
        f"{difference} (`train.elastic: true` resumes with another world size, "
        "micro_batch_size or num_workers)"
    ) in str(err.value)


def test_the_plain_command_after_an_extension_says_how_to_continue(
    harness, tmp_path, corpus, base_run
) -> None:
    config = _config(harness, tmp_path, corpus, base_run, train={"max_steps": 1})
    _run(config)
    _run(config, "train.max_steps=2")  # extends the finished run
    with pytest.raises(RankError) as err:
        _run(config)  # the command without --set again
    assert (
        "training.recipe.max_steps: checkpoint 2 != now 1 (this run was extended to 2 steps: "
        "continue it with --set train.max_steps=2"
    ) in str(err.value)
    _run(config, "train.max_steps=2")  # as it says: accepted (finished, nothing to train)
