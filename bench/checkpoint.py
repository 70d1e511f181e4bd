"""Checkpoint cost on CPU: the training pause per checkpoint, synchronous vs asynchronous, and
the load time of ``generate`` on the same run, before (whole file) vs after (model only,
loaded into a model built without random init).

    python bench/checkpoint.py [--d-model 1024] [--layers 18] [--rounds 3]

Builds the embedded sample corpus, a random base of about 300M parameters (the ``tiny``
preset widened: d_model 1024, 18 layers, ffn 2816, untied, vocab 32k), and a real run
(``prepare_run``), trains 2 steps so AdamW holds its state (a checkpoint of ~3.5 GB), then
calls the trainer's own ``save_checkpoint`` ``--rounds`` times each way, interleaved:

* sync (``train.async_checkpoint: false``): the pause is the whole write (serialise, hash,
  fsync, rename, rotation);
* async: the pause is copying the state into CPU buffers; the write then runs in the
  background (its time is reported too: training overlaps it, and the next checkpoint waits
  for it only if it comes sooner). The buffers were reserved by ``prepare_run``, in the
  background, as in any run (``StagedCopies.reserve``).

Target: async pause <= 15% of the sync pause (medians).

Then ``generate``'s load of that run dir, timed alternately, page cache warm for both:

* before: the newest checkpoint verified whole (``latest_checkpoint``), read again verified
  whole and mapped (``load_checkpoint``), weights loaded into a freshly initialised model: what
  ``generate`` did before;
* after: ``newest_model_checkpoint`` (the model tensors alone read and verified, mapped; the
  optimizer state never read), weights loaded into a model built without random init
  (``build_model(cfg, init_weights=False)``): what ``generate`` does now.

The tokenizer (the same for both) is left out.
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch
import yaml

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.data.format import read_special_tokens
from nedolm.dist import get_info
from nedolm.model import ModelConfig, build_model
from nedolm.train.base import init_base
from nedolm.train.checkpoint import latest_checkpoint, load_checkpoint, newest_model_checkpoint
from nedolm.train.config import load_sft_config
from nedolm.train.loop import Trainer
from nedolm.train.metrics import MetricsWriter, read_metrics, setup_logging
from nedolm.train.setup import prepare_run
from nedolm.train.signals import StopRequest
from nedolm.train.state import load_model_weights
from nedolm.train.testing import sft_paths

DEFAULT = Path(__file__).resolve().parents[1] / "apps" / "sft" / "src" / "nedolm_sft" / "default"
TARGET = 0.15
SEQ_LEN = 128


def _prepare(root: Path, args: argparse.Namespace) -> Path:
    data, tokenizer = root / "data", root / "tokenizer.json"
    tokenizer.write_bytes(gzip.decompress((DEFAULT / "tokenizer.json.gz").read_bytes()))
    build_corpus(
        [DEFAULT / "tr_chat_sample.jsonl"],
        tokenizer,
        data,
        BuildOptions(seq_len=SEQ_LEN, shards=4, val_shards=(3,)),
    )
    special = read_special_tokens(data)
    init_base(
        root / "base",
        preset_name="tiny",
        vocab_size=special.vocab_size,
        eos_id=special.eos_id,
        overrides={
            "d_model": args.d_model,
            "n_layers": args.layers,
            "n_heads": args.d_model // 64,
            "n_kv_heads": args.d_model // 64,
            "ffn_dim": args.d_model * 11 // 4,
            "morph_expert_dim": 64,
            "max_seq_len": SEQ_LEN,
            "tie_embeddings": False,
        },
    )
    config = {
        **sft_paths(root / "run", root / "base", data),
        "optim": {"warmup_steps": 1},
        "train": {
            "seq_len": SEQ_LEN,
            "micro_batch_size": 1,
            "grad_accum_steps": 1,
            "max_steps": 10_000,
            "num_workers": 0,
            "compile": False,
            "log_interval": 1,
            "ckpt_interval": 10_000,
            "keep_last": 1,
            "keep_every": 0,
            "archive_interval_hours": 0.0,
            "save_final_checkpoint": False,
        },
        "validation": {"enabled": False},
    }
    path = root / "sft.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def _model_for(payload: dict, *, init_weights: bool) -> torch.nn.Module:
    trained = payload["contract"]["training"]["recipe"]["model_config"]
    cfg = ModelConfig(**{**trained, "morph_dispatch": "sparse", "attn_impl": "sdpa"})
    return build_model(cfg, init_weights=init_weights)


def _load_before(run_dir: Path) -> torch.nn.Module:
    """What generate did before: the whole file verified twice, a freshly initialised model
    given the weights from the mapping."""
    path = latest_checkpoint(run_dir)
    assert path is not None
    payload = load_checkpoint(path)
    model = _model_for(payload, init_weights=True)
    model.load_state_dict(payload["model"])
    return model


def _load_after(run_dir: Path) -> torch.nn.Module:
    """What generate does now (``chat_model._load_run`` without the tokenizer)."""
    newest = newest_model_checkpoint(run_dir)
    assert newest is not None
    path, payload = newest
    model = _model_for(payload, init_weights=False)
    load_model_weights(path, payload, model)
    return model


def _timed(fn, *args) -> float:
    started = time.perf_counter()
    result = fn(*args)
    del result
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        cfg = load_sft_config(_prepare(Path(tmp), args))
        cfg.run_dir.mkdir()
        setup_logging(cfg.run_dir)
        run = prepare_run(cfg, get_info(), smoke_steps=2, allow_compile=False)
        trainer = Trainer(run, StopRequest(), MetricsWriter(cfg.run_dir))
        trainer.train()  # 2 steps: AdamW holds its state now
        params = sum(p.numel() for p in run.state.model.parameters())
        for _ in range(args.rounds):
            for background in (False, True):
                trainer.async_save = background
                trainer.save_checkpoint()
                trainer.collect_background_write(block=True)
        trainer.writer.close()
        saves = [r for r in read_metrics(cfg.run_dir) if r.get("kind") == "checkpoint"]
        size = latest_checkpoint(cfg.run_dir).stat().st_size
        old_loads, new_loads = [], []
        for _ in range(args.rounds):
            old_loads.append(_timed(_load_before, cfg.run_dir))
            new_loads.append(_timed(_load_after, cfg.run_dir))

    sync = [r["pause_s"] for r in saves if not r["background"]]
    staged = [r["pause_s"] for r in saves if r["background"]]
    written = [r["write_s"] for r in saves if r["background"]]
    print(
        f"{params / 1e6:.0f}M parameters + AdamW, checkpoint {size / 2**30:.2f} GiB, "
        f"CPU x{torch.get_num_threads()} threads, {args.rounds} rounds (medians; all values)"
    )
    rows = [
        ("sync save: training pause", sync),
        ("async save: training pause", staged),
        ("async save: background write", written),
        ("generate weights before (whole file)", old_loads),
        ("generate weights after (model only, no random init)", new_loads),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{'measure':<{width}}{'median s':>10}  all")
    for name, values in rows:
        listed = " ".join(f"{v:.2f}" for v in values)
        print(f"{name:<{width}}{statistics.median(values):>10.2f}  {listed}")
    pause_ratio = statistics.median(staged) / statistics.median(sync)
    load_ratio = statistics.median(new_loads) / statistics.median(old_loads)
    verdict = "OK" if pause_ratio <= TARGET else "OVER"
    print(f"async pause / sync pause: {100 * pause_ratio:.1f}% (target <= 15%): {verdict}")
    print(f"generate load after / before: {100 * load_ratio:.1f}%")


if __name__ == "__main__":
    main()
