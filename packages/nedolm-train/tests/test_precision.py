"""``train.precision``: what each setting computes in on each kind of device, the refusal of bf16
on a GPU without bf16 tensor cores, and a real run that computes in the dtype it was given."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from nedolm.train.config import load_sft_config
from nedolm.train.metrics import read_metrics
from nedolm.train.precision import (
    Gpu,
    PrecisionError,
    choose_precision,
    gpu_of,
    resolve_precision,
)
from nedolm.train.trainer import run

H200 = Gpu("NVIDIA H200", (9, 0), native_bf16=True)
A100 = Gpu("NVIDIA A100-SXM4-80GB", (8, 0), native_bf16=True)
T4 = Gpu("Tesla T4", (7, 5), native_bf16=False)
V100 = Gpu("Tesla V100-SXM2-32GB", (7, 0), native_bf16=False)


@pytest.mark.parametrize(
    ("precision", "gpu", "compute"),
    [
        ("auto", None, "fp32"),
        ("auto", H200, "bf16"),
        ("auto", A100, "bf16"),
        ("auto", T4, "fp32"),
        ("auto", V100, "fp32"),
        ("bf16", None, "bf16"),
        ("bf16", H200, "bf16"),
        ("fp32", None, "fp32"),
        ("fp32", H200, "fp32"),
        ("fp32", T4, "fp32"),
    ],
)
def test_each_setting_on_each_device(precision: str, gpu: Gpu | None, compute: str) -> None:
    assert choose_precision(precision, gpu) == compute


@pytest.mark.parametrize("gpu", [T4, V100], ids=["T4", "V100"])
def test_bf16_is_refused_on_a_gpu_before_ampere_naming_it_and_the_key(gpu: Gpu) -> None:
    major, minor = gpu.capability
    with pytest.raises(PrecisionError) as refused:
        choose_precision("bf16", gpu)
    message = str(refused.value)
    assert f"{gpu.name} (compute capability {major}.{minor})" in message
    assert "train.precision" in message and "fp32" in message


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="precision must be one of"):
        choose_precision("fp16", None)


def test_a_cpu_has_no_gpu_and_auto_says_what_it_chose(caplog) -> None:
    cpu = torch.device("cpu")
    assert gpu_of(cpu) is None
    with caplog.at_level(logging.INFO, logger="nedolm.train.precision"):
        assert resolve_precision("auto", cpu) == "fp32"
        assert resolve_precision("bf16", cpu) == "bf16"  # asked for: nothing to explain
    assert [r.getMessage() for r in caplog.records] == ["train.precision auto: fp32 on cpu"]


def _first_losses(make_config, precision: str, computes: str) -> tuple[float, float]:
    """Validation loss before training and the first step's loss (both on the base weights);
    the start's record in run_metadata.json names what it computed in."""
    config = make_config(precision, train={"max_steps": 1, "precision": precision})
    run(load_sft_config(config), compile=False)
    run_dir = config.with_suffix("")
    meta = json.loads((run_dir / "run_metadata.json").read_text(encoding="utf-8"))
    assert meta["starts"][-1]["precision"] == computes
    records = read_metrics(run_dir)
    first_val = next(r["val_loss"] for r in records if r.get("kind") == "validation")
    first_train = next(r["loss"] for r in records if "loss" in r)
    return first_val, first_train


def test_a_ddp_run_computes_in_the_precision_it_is_given(make_config) -> None:
    """On a CPU ``auto`` is fp32 and equals ``fp32`` exactly; ``bf16`` autocasts the same
    weights, so its losses differ by bf16 rounding: not at all would mean the setting was
    ignored (as DDP ignored it before), much would mean a bug."""
    fp32 = _first_losses(make_config, "fp32", computes="fp32")
    assert _first_losses(make_config, "auto", computes="fp32") == fp32
    bf16 = _first_losses(make_config, "bfloat16", computes="bf16")
    for got, want in zip(bf16, fp32, strict=True):
        assert got != want
        assert got == pytest.approx(want, rel=2e-2)
