"""FSDP2 against DDP: optimizer-step time and memory per rank, 2 gloo ranks on the CPU.

    python bench/fsdp.py [--steps 12] [--warmup 2] [--seq-len 256] [--micro-batch 2]

Runs the ``tiny`` preset (real 32003-token vocabulary) under each mode in turn, each in its
own fresh 2-process group, on the same machine in the same invocation. Per rank it reports:

* step: median wall time of the timed optimizer steps (forward, backward, clip, AdamW);
* state: bytes this rank holds in parameters + gradients + AdamW moments (local shards under
  FSDP), counted exactly from the tensors after the last step;
* peak RSS: the process's ``ru_maxrss`` (includes the torch runtime, measured before the
  model is built and shown as ``base``), the OS view of the whole process.

On a GPU the gap is larger: FSDP also keeps parameters in bf16 only while a block computes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # two ranks share the cores

import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from nedolm.dist import cleanup, setup_distributed
from nedolm.model import build_model, preset
from nedolm.train.config import OptimConfig
from nedolm.train.optim import build_optimizer
from nedolm.train.parallel import maybe_no_sync, parallelize
from nedolm.train.step import clip_grad_norm

WORLD_SIZE = 2


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _local_bytes(tensors: list[torch.Tensor]) -> int:
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def _state_mib(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    moments = [v for s in optimizer.state.values() for v in s.values() if v.ndim > 0]
    return (_local_bytes(params) + _local_bytes(grads) + _local_bytes(moments)) / 2**20


def _rank(rank: int, mode: str, port: int, args: argparse.Namespace, out: Path) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    info = setup_distributed(backend="gloo")
    base_rss = _rss_mib()
    torch.manual_seed(0)
    cfg = preset("tiny", vocab_size=32003, max_seq_len=args.seq_len)
    model = parallelize(build_model(cfg), mode, device=info.device, compute="fp32")  # gloo: CPU
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4, warmup_steps=1))
    gen = torch.Generator().manual_seed(rank)
    times = []
    for step in range(args.warmup + args.steps):
        started = time.perf_counter()
        for micro in range(2):  # two micro-batches: DDP skips the first all-reduce
            ids = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq_len), generator=gen)
            with maybe_no_sync(model, last_micro_batch=micro == 1):
                loss, _ = model(ids[:, :-1], labels=ids[:, 1:], return_logits=False)
                loss.backward()
        clip_grad_norm(list(model.parameters()), 1.0)
        optimizer.step()
        if step == args.warmup + args.steps - 1:
            state = _state_mib(model, optimizer)  # before zero_grad: gradients still held
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    row = {
        "step_ms": 1000 * statistics.median(times),
        "state_mib": state,
        "peak_rss_mib": _rss_mib(),
        "base_rss_mib": base_rss,
        "params": sum(p.numel() for p in model.parameters()),
    }
    (out / f"{mode}-{info.rank}.json").write_text(json.dumps(row), encoding="utf-8")
    del model, optimizer  # the wrapped model must be freed before its process group
    cleanup()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for mode in ("ddp", "fsdp"):
            mp.spawn(_rank, args=(mode, _free_port(), args, out), nprocs=WORLD_SIZE)
        rows = {
            (mode, rank): json.loads((out / f"{mode}-{rank}.json").read_text(encoding="utf-8"))
            for mode in ("ddp", "fsdp")
            for rank in range(WORLD_SIZE)
        }
    params = rows["ddp", 0]["params"]
    print(f"tiny preset, {params / 1e6:.1f}M params, {WORLD_SIZE} gloo ranks, {args.steps} steps")
    print("mode  rank  step ms (median)  state MiB  peak RSS MiB  base RSS MiB")
    for (mode, rank), row in rows.items():
        print(
            f"{mode:<5} {rank:>4}  {row['step_ms']:>16.1f}  {row['state_mib']:>9.1f}  "
            f"{row['peak_rss_mib']:>12.1f}  {row['base_rss_mib']:>12.1f}"
        )
    for key in ("step_ms", "state_mib", "peak_rss_mib"):
        ratio = statistics.mean(rows["fsdp", r][key] / rows["ddp", r][key] for r in range(2))
        print(f"fsdp / ddp {key}: {ratio:.2f}")


if __name__ == "__main__":
    main()
