"""One rank of a DDP/FSDP training test: ``python parallel_worker.py OUT_DIR MODE [options]``.

Trains a tiny MorphTransformer on a fixed batch stream (a pure function of step, rank and
micro-batch) with the project's optimizer builder, LR schedule and gradient clipping, and the
step's loss rule (summed loss scaled by ``world_size / global_targets``). Rank 0 writes
``losses.json`` (``{step: loss}``, floats exact through JSON), ``final.pt`` (the full model
state) and, at ``--save-at``, ``full-STEP.pt`` (full model + optimizer state) next to the sharded checkpoint.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from nedolm.dist import DistInfo, cleanup, setup_distributed, sum_all
from nedolm.model import IGNORE_INDEX, build_model, packed_layout, preset
from nedolm.train.config import OptimConfig
from nedolm.train.optim import build_optimizer, lr_at_step, set_lr
from nedolm.train.parallel import maybe_no_sync, parallelize
from nedolm.train.sharded import (
    full_model_state,
    full_state,
    load_full_state,
    load_sharded,
    save_sharded,
)
from nedolm.train.step import clip_grad_norm

MODEL = preset(
    "tiny",
    vocab_size=256,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=128,
    n_morph_classes=3,
    morph_expert_dim=32,
    max_seq_len=64,
)
OPTIM = OptimConfig(lr=3e-3, warmup_steps=3, schedule="cosine")
MAX_STEPS = 10
EOS_ID = 2
ROWS, SEQ_LEN, MICRO_BATCHES = 2, 32, 2


def micro_batch(step: int, rank: int, micro: int) -> dict[str, torch.Tensor]:
    """Tokens with a few EOS (several segments per row) and a random trainable mask."""
    gen = torch.Generator().manual_seed(1_000_003 * step + 1009 * rank + micro)
    tokens = torch.randint(3, MODEL.vocab_size, (ROWS, SEQ_LEN + 1), generator=gen)
    tokens[torch.rand(tokens.shape, generator=gen) < 0.08] = EOS_ID
    mask = torch.rand(tokens.shape, generator=gen) < 0.6
    inputs = tokens[:, :-1].contiguous()
    labels = tokens[:, 1:].masked_fill(~mask[:, 1:], IGNORE_INDEX)
    cu_seqlens, position_ids = packed_layout(inputs, EOS_ID)
    return {"inputs": inputs, "labels": labels, "cu_seqlens": cu_seqlens, "pos": position_ids}


def loss_sum(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """The fused assistant-only head, as the SFT step calls it (summed over targets)."""
    loss, _ = model(
        mb["inputs"],
        labels=mb["labels"],
        return_logits=False,
        loss_reduction="sum",
        cu_seqlens=mb["cu_seqlens"],
        max_seqlen=SEQ_LEN,
        position_ids=mb["pos"],
    )
    return loss


def train_step(model, optimizer, step: int, rank: int, world_size: int) -> float:
    batches = [micro_batch(step, rank, m) for m in range(MICRO_BATCHES)]
    local_targets = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in batches)
    global_targets = int(sum_all(torch.tensor(local_targets)))
    scale = world_size / global_targets
    local_loss = torch.zeros(())
    for i, mb in enumerate(batches):
        with maybe_no_sync(model, last_micro_batch=i == MICRO_BATCHES - 1):
            loss = loss_sum(model, mb)
            (loss * scale).backward()
        local_loss += loss.detach()
    params = [p for p in model.parameters() if p.requires_grad]
    clip_grad_norm(params, OPTIM.grad_clip)
    set_lr(optimizer, lr_at_step(step, OPTIM, MAX_STEPS))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(sum_all(local_loss)) / global_targets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("mode", choices=["ddp", "fsdp"])
    parser.add_argument("--start", type=int, default=0, help="first step to run")
    parser.add_argument("--stop", type=int, default=MAX_STEPS, help="run steps [start, stop)")
    parser.add_argument("--init-seed", type=int, default=0)
    parser.add_argument("--save-at", type=int, help="before this step: sharded + full save")
    parser.add_argument("--load-sharded", type=Path)
    parser.add_argument("--load-full", type=Path, help="full-STEP.pt of another run")
    parser.add_argument("--hold-at", type=int, help="before this step: signal, then sleep")
    args = parser.parse_args()
    info = setup_distributed(backend="gloo")
    run(args, info)  # returns without a reference to the wrapped model, which cleanup needs
    cleanup()


def run(args: argparse.Namespace, info: DistInfo) -> None:
    """Train, save and hold as the options say; writes the outputs on rank 0."""
    torch.manual_seed(args.init_seed)  # the same initial weights on every rank
    model = parallelize(build_model(MODEL), args.mode, device=info.device, compute="fp32")
    optimizer = build_optimizer(model, OPTIM)
    if args.load_sharded:
        assert load_sharded(args.load_sharded, model, optimizer) == {"step": args.start}
    if args.load_full:
        full = torch.load(args.load_full, weights_only=True) if info.is_main else {}
        load_full_state(model, optimizer, full.get("model", {}), full.get("optim", {}))

    losses: dict[int, float] = {}
    for step in range(args.start, args.stop):
        if step == args.save_at:
            save_sharded(args.out_dir / "sharded", model, optimizer, {"step": step})
            model_state, optim_state = full_state(model, optimizer)
            if info.is_main:
                torch.save(
                    {"model": model_state, "optim": optim_state}, args.out_dir / f"full-{step}.pt"
                )
        if step == args.hold_at:
            (args.out_dir / f"holding{info.rank}").touch()
            time.sleep(600)  # the test SIGKILLs this rank here
        losses[step] = train_step(model, optimizer, step, info.rank, info.world_size)

    final = full_model_state(model)
    if info.is_main:
        torch.save(final, args.out_dir / "final.pt")
        (args.out_dir / "losses.json").write_text(json.dumps(losses), encoding="utf-8")


if __name__ == "__main__":
    main()
