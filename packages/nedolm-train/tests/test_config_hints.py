"""Config keys as a user coming from another trainer writes them: a peer's name (Hugging Face
TrainingArguments, TRL, Axolotl, LLaMA-Factory) or one of ours in the wrong section is answered
with the NedoLM name; torch's dtype names are read as ours; warm-up may be a fraction."""

from __future__ import annotations

from pathlib import Path

import pytest

from nedolm.train.config import ConfigError, OptimConfig, load_sft_config
from nedolm.train.optim import lr_at_step

MINIMAL = "run_dir: r\nbase_config: b.yaml\nbase_run_dir: br\ndata_dir: d\n"


def _load(tmp_path: Path, text: str, overrides: tuple[str, ...] = ()):
    path = tmp_path / "sft.yaml"
    path.write_text(MINIMAL + text, encoding="utf-8")
    return load_sft_config(path, overrides)


@pytest.mark.parametrize(
    ("text", "ours"),
    [
        ("train: {learning_rate: 1.0e-4}", "`train.learning_rate`: NedoLM calls it `optim.lr`"),
        ("learning_rate: 1.0e-4", "`learning_rate`: NedoLM calls it `optim.lr`"),
        (
            "train: {num_train_epochs: 3}",
            "`train.num_train_epochs`: NedoLM calls it `train.num_epochs`",
        ),
        (
            "train: {per_device_train_batch_size: 4}",
            "`train.per_device_train_batch_size`: NedoLM calls it `train.micro_batch_size`",
        ),
        (
            "train: {gradient_accumulation_steps: 8}",
            "`train.gradient_accumulation_steps`: NedoLM calls it `train.grad_accum_steps`",
        ),
        (
            "train: {warmup_ratio: 0.1}",
            "`train.warmup_ratio`: NedoLM calls it `optim.warmup_ratio`",
        ),
        (
            "train: {max_seq_length: 2048}",
            "`train.max_seq_length`: NedoLM calls it `train.seq_len`",
        ),
        ("optim: {seq_len: 2048}", "`optim.seq_len`: NedoLM calls it `train.seq_len`"),
        (
            "train: {weight_decay: 0.0}",
            "`train.weight_decay`: NedoLM calls it `optim.weight_decay`",
        ),
        (
            "optim: {lr_scheduler_type: cosine}",
            "`optim.lr_scheduler_type`: NedoLM calls it `optim.schedule`",
        ),
        ("train: {save_steps: 500}", "`train.save_steps`: NedoLM calls it `train.ckpt_interval`"),
        (
            "train: {logging_steps: 5}",
            "`train.logging_steps`: NedoLM calls it `train.log_interval`",
        ),
        ("train: {eval_steps: 100}", "`train.eval_steps`: NedoLM calls it `validation.interval`"),
        ("optim: {max_grad_norm: 1.0}", "`optim.max_grad_norm`: NedoLM calls it `optim.grad_clip`"),
        ("output_dir: out", "`output_dir`: NedoLM calls it `run_dir`"),
        ("seed: 3", "`seed`: NedoLM calls it `train.seed` or `validation.seed`"),
    ],
)
def test_a_peers_key_is_answered_with_ours(tmp_path: Path, text: str, ours: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text + "\n")
    assert f"unknown key {ours}" in str(err.value)


def test_a_peers_key_in_set_is_answered_with_ours(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, "", ("train.learning_rate=1e-4",))
    assert "unknown key `train.learning_rate`: NedoLM calls it `optim.lr`" in str(err.value)


def test_a_typo_still_gets_the_nearest_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key `lrr` in `optim`; did you mean `lr`"):
        _load(tmp_path, "optim: {lrr: 1.0}\n")


@pytest.mark.parametrize(
    ("given", "read"), [("bfloat16", "bf16"), ("float32", "fp32"), ("bf16", "bf16")]
)
def test_torch_dtype_names_are_read_as_precisions(tmp_path: Path, given: str, read: str) -> None:
    assert _load(tmp_path, f"train: {{precision: {given}}}\n").train.precision == read


def test_warmup_ratio_is_a_fraction_of_the_steps_rounded_up() -> None:
    ratio = OptimConfig(lr=1.0, warmup_ratio=0.1)
    steps = OptimConfig(lr=1.0, warmup_steps=3)  # ceil(0.1 * 25)
    assert ratio.warmup_for(25) == 3 and OptimConfig().warmup_for(25) == 100
    assert [lr_at_step(s, ratio, 25) for s in range(25)] == [
        lr_at_step(s, steps, 25) for s in range(25)
    ]


def test_warmup_ratio_and_warmup_steps_are_not_both_given(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"give optim.warmup_steps \(10\) or optim.warmup_ratio"):
        _load(tmp_path, "optim: {warmup_steps: 10, warmup_ratio: 0.1}\n")
    with pytest.raises(ConfigError, match=r"optim.warmup_ratio must be in \[0, 1\], got 1.5"):
        _load(tmp_path, "optim: {warmup_ratio: 1.5}\n")
