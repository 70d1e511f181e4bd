"""What ``bench/model_gpu.py`` times and hands the trainer's GPU run: micro-batches made as the
trainer makes them, of the real corpus' lengths, and the backend and dispatch choices, which
must not follow noise."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from nedolm.data.synthetic import EOS_ID, PAD_ID
from nedolm.model import packed_layout

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def model_gpu():
    spec = importlib.util.spec_from_file_location("model_gpu", BENCH / "model_gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["model_gpu"] = module
    spec.loader.exec_module(module)
    return module


def test_micro_batches_are_the_products_on_the_real_corpus_lengths(model_gpu) -> None:
    counts, longest = [], []
    for seed in range(3):
        micro = model_gpu.product_micro_batches(4, 4096, "cpu", 4, seed)
        for mb in micro:
            assert mb.inputs.shape == mb.labels.shape == (4, 4096)
            input_ids, labels, layout = model_gpu.model_inputs(mb)
            cu_seqlens, _ = packed_layout(input_ids, EOS_ID)  # every conversation its segment
            assert torch.equal(layout["cu_seqlens"], cu_seqlens)
            segments = cu_seqlens.diff()
            assert layout["max_seqlen"] == int(segments.max()) <= 4096
            assert int((labels != -100).sum()) == mb.targets  # the loader's assistant targets
            assert 0.15 < mb.targets / labels.numel() < 0.4  # the real corpus: 28%
            assert float((input_ids == PAD_ID).float().mean()) < 0.02  # the packer fills rows
            counts.append(len(segments))
            longest.append(mb.max_seqlen)
        assert len({mb.inputs.sum().item() for mb in micro}) == len(micro)  # distinct batches
    # The packer's best-fit decreasing: some micro-batches of a few long conversations, some
    # of a hundred short ones (the real corpus: ~86 a micro-batch at the median).
    assert min(counts) < 40 and max(counts) > 100, counts
    assert 30 <= sorted(counts)[len(counts) // 2] <= 150, counts
    assert 500 < sorted(longest)[len(longest) // 2] < 3500, longest


def test_a_choice_leaves_the_default_only_when_faster_beyond_noise(model_gpu) -> None:
    steady = model_gpu.StepTime
    step_s = {("auto", True): steady(1.00, 0.0), ("close", True): steady(0.99, 0.0)}
    step_s[("fast", True)] = steady(0.95, 0.01)
    step_s[("eager only", False)] = steady(0.5, 0.0)  # eager rows never decide
    choose = model_gpu.faster
    assert choose("backend", step_s, {"auto": "auto", "close": "close"}, "auto") == "auto"
    assert choose("backend", step_s, {"auto": "auto", "fast": "fast"}, "auto") == "fast"
    assert choose("backend", step_s, {"auto": "auto", "eager only": "eager only"}, "auto") == "auto"
    # The default failed to run: the fastest that ran; nothing ran: the default.
    assert choose("backend", step_s, {"gone": "gone", "close": "close"}, "gone") == "close"
    assert choose("backend", {}, {"auto": "auto"}, "auto") == "auto"


def test_a_measured_spread_wider_than_the_difference_keeps_the_default(model_gpu) -> None:
    step_s = {("auto", True): model_gpu.StepTime(1.00, 0.08)}
    step_s[("fast", True)] = model_gpu.StepTime(0.95, 0.01)  # 5% faster, but auto's rows vary 8%
    assert model_gpu.faster("backend", step_s, {"auto": "auto", "fast": "fast"}, "auto") == "auto"
    step_s[("auto", True)] = model_gpu.StepTime(1.00, 0.01)
    step_s[("fast", True)] = model_gpu.StepTime(0.95, 0.06)  # the challenger's own rows vary 6%
    assert model_gpu.faster("backend", step_s, {"auto": "auto", "fast": "fast"}, "auto") == "auto"
    step_s[("fast", True)] = model_gpu.StepTime(0.90, 0.06)  # 10% faster: beyond both
    assert model_gpu.faster("backend", step_s, {"auto": "auto", "fast": "fast"}, "auto") == "fast"


def test_step_time_spread_is_the_interquartile_range_over_the_median(model_gpu) -> None:
    # 8 steps sorted, inclusive quartiles at positions 1.75 and 5.25: 0.10875 and 0.11225; the
    # one slow outlier (0.200) moves neither.
    times = [0.110, 0.100, 0.111, 0.109, 0.112, 0.108, 0.113, 0.200]
    timed = model_gpu.StepTime.of(times)
    assert timed.median_s == pytest.approx(0.1105)
    assert timed.spread == pytest.approx((0.11225 - 0.10875) / 0.1105)
    assert model_gpu.StepTime.of([0.1]) == (0.1, 0.0)  # one step: no spread to measure
