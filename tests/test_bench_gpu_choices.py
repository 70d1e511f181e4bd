"""What ``bench/model_gpu.py`` hands the trainer's GPU run: rows shaped like the real corpus,
and the backend and dispatch choices, which must not follow noise."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from nedolm.model import packed_layout, preset

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def model_gpu():
    spec = importlib.util.spec_from_file_location("model_gpu", BENCH / "model_gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["model_gpu"] = module
    spec.loader.exec_module(module)
    return module


def test_rows_hold_the_real_corpus_segment_counts_without_padding(model_gpu) -> None:
    cfg = preset("nedolm-0.8b", max_seq_len=4096)
    for seed in range(3):
        input_ids, labels, layout, segments = model_gpu.packed_rows(cfg, 4, 4096, "cpu", seed)
        # The real corpus: ~86 conversations per 4x4096 micro-batch, most of a few dozen tokens.
        assert 60 <= len(segments) <= 130, len(segments)
        assert 16 <= segments.median() <= 80 and segments.max() <= 4096
        assert int(segments.sum()) == input_ids.numel()  # back to back: no padding
        assert layout["max_seqlen"] == int(segments.max())
        cu_seqlens, _ = packed_layout(input_ids, model_gpu.EOS_ID)
        assert torch.equal(layout["cu_seqlens"], cu_seqlens)
        assert 0.3 < float((labels != -100).float().mean()) < 0.5  # 40% targets


def test_a_choice_leaves_the_default_only_when_faster_beyond_noise(model_gpu) -> None:
    step_s = {("auto", True): 1.00, ("close", True): 0.99, ("fast", True): 0.95}
    step_s[("eager only", False)] = 0.5  # eager rows never decide
    choose = model_gpu.faster
    assert choose("backend", step_s, {"auto": "auto", "close": "close"}, "auto") == "auto"
    assert choose("backend", step_s, {"auto": "auto", "fast": "fast"}, "auto") == "fast"
    assert choose("backend", step_s, {"auto": "auto", "eager only": "eager only"}, "auto") == "auto"
    # The default failed to run: the fastest that ran; nothing ran: the default.
    assert choose("backend", step_s, {"gone": "gone", "close": "close"}, "gone") == "close"
    assert choose("backend", {}, {"auto": "auto"}, "auto") == "auto"
