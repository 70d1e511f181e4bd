"""FSDP's background checkpoint: the training pause with DCP's default staging (new CPU copies
per save) vs the stager the trainer keeps for the run (``sharded.kept_stager``), on the CPU.

    python bench/sharded_save.py [--d-model 1024] [--layers 18] [--rounds 4]

One gloo rank in this process, the model FSDP-wrapped (the ``tiny`` preset widened, as in
``bench/checkpoint.py``: ~308M parameters, untied, vocab 32k) with AdamW's state after one step,
so the shards hold ~3.4 GiB. Each round saves once each way, alternating which goes first,
through the trainer's own ``start_sharded_save``: the pause is that call (the staging), the
write is ``finish`` after it (DCP's thread writes the shards, rank 0 seals). Both ways write the
same checkpoint. On torch 2.11 there is no kept stager (``kept_stager`` returns None):
the bench says so and stops.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch

from nedolm.dist import cleanup, setup_distributed
from nedolm.model import build_model, preset
from nedolm.train.config import OptimConfig
from nedolm.train.optim import build_optimizer
from nedolm.train.parallel import parallelize
from nedolm.train.sharded import ShardedBackground, kept_stager, start_sharded_save

TARGET = 0.5  # the kept stager's pause at most half the default's (medians)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _trained_fsdp_model(args: argparse.Namespace, device: torch.device):
    torch.manual_seed(0)
    cfg = preset(
        "tiny",
        vocab_size=32003,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.d_model // 64,
        n_kv_heads=args.d_model // 64,
        ffn_dim=args.d_model * 11 // 4,
        morph_expert_dim=64,
        max_seq_len=64,
        tie_embeddings=False,
    )
    model = parallelize(build_model(cfg), "fsdp", device=device, compute="fp32")
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4, warmup_steps=1))
    ids = torch.randint(0, cfg.vocab_size, (1, 65))
    loss, _ = model(ids[:, :-1], labels=ids[:, 1:], return_logits=False)
    loss.backward()
    optimizer.step()  # AdamW's moments exist: the shards are what a run saves
    return model, optimizer


def _save(root: Path, name: str, model, optimizer, background: ShardedBackground):
    started = time.perf_counter()
    save = start_sharded_save(root / name, model, optimizer, {"step": 1}, {}, background=background)
    paused = time.perf_counter() - started
    save.finish()
    return paused, time.perf_counter() - started - paused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )
    info = setup_distributed(backend="gloo")
    stager = kept_stager(info.device)
    if stager is None:
        print(
            f"torch {torch.__version__}: no kept stager (DCP's stager stages once): "
            "nothing to compare"
        )
        cleanup()
        return
    model, optimizer = _trained_fsdp_model(args, info.device)
    group = torch.distributed.new_group(backend="gloo")
    ways = {
        "DCP's default (new copies per save)": ShardedBackground(group, None),
        "kept stager (copies reused)": ShardedBackground(group, stager),
    }
    pauses: dict[str, list[float]] = {way: [] for way in ways}
    writes: dict[str, list[float]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = list(ways) if round_ % 2 == 0 else list(reversed(ways))
            for index, way in enumerate(order):
                paused, written = _save(
                    Path(tmp), f"r{round_}-{index}", model, optimizer, ways[way]
                )
                pauses[way].append(paused)
                writes[way].append(written)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.0f}M parameters + AdamW, FSDP on 1 gloo rank, CPU, {args.rounds} rounds")
    print(f"{'staging':<38}{'pause s (median)':>18}{'write s':>9}  all pauses")
    for way in ways:
        every = " ".join(f"{p:.2f}" for p in pauses[way])
        print(
            f"{way:<38}{statistics.median(pauses[way]):>18.2f}"
            f"{statistics.median(writes[way]):>9.2f}  {every}"
        )
    default, kept = (statistics.median(pauses[way]) for way in ways)
    verdict = "OK" if kept <= TARGET * default else "MISSED"
    print(f"kept / default pause: {kept / default:.2f} (target <= {TARGET}): {verdict}")
    del model, optimizer
    cleanup()


if __name__ == "__main__":
    main()
