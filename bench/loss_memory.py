"""The fused loss head's memory above its inputs and the bytes its ops move, at
bench/loss_gpu.py's shape, counted on CPU.

    python bench/loss_memory.py      # about 40 s on 2 cores

`torch.cuda.max_memory_allocated` is the sum of live tensors' storages at its peak; the
`LiveBytes` counter of packages/nedolm-model/tests/test_loss_memory.py adds up the same on a CPU
run of the same code, so a GPU's figure can be predicted (and a regression found) without one.
Ops inside the custom op are invisible from outside it, so two counts are taken: the op's body
(its bf16 copy of the weight and the chunk loop) and the op as autograd runs it (its outputs and
backward); the head's peak is the larger. The H200 measured 0.40 GiB for the head whose counts
here were 0.388 and 0.404 GiB.

The head is bound by memory traffic on a GPU (its GEMMs are ~3 ms of an H200's time), so the
body's ops are also counted by the bytes they read and write (`Traffic`: every tensor argument
read, every output written; views move nothing) and by how many there are (kernel launches):
a proxy for its GPU time that a CPU can measure. On this CPU bf16 gradients reach the float32
weight gradient through slices of a bf16 product; a GPU runs one GEMM with a float32 output
instead (loss.add_weight_grad), which moves less.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages/nedolm-model/tests"))
from test_loss_memory import LiveBytes

from nedolm.model import fused_linear_cross_entropy, loss
from nedolm.model.loss import LOSS_CHUNK_ELEMENTS

ROWS, VOCAB, PADDED, DIM = 6553, 32003, 32064, 1536  # 40% of 4 x 4096 positions
GEMMS = {"mm", "addmm", "bmm"}


class Traffic(TorchDispatchMode):
    """Bytes read and written and ops run, GEMMs apart from the rest.

    Every tensor argument counts as read and every output as written, except where a kernel
    touches less: allocations and views move nothing, a copy onto the same data is skipped by
    torch (`t[i] += x` ends with one), and a scatter writes only the entries it is given.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or "empty" in name or (name == "copy_" and _same_data(*args[:2])):
            return out
        if name.startswith(("scatter", "index_put")):
            moved = 2 * _nbytes(args[1:])  # the indices and values, read and then written
        else:
            moved = _nbytes(args) + _nbytes({k: v for k, v in kwargs.items() if k != "out"})
            moved += _nbytes(out)
        kind = "GEMM" if name in GEMMS else "other"
        self.bytes[kind] += moved
        self.ops[kind] += 1
        return out


def _same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _nbytes(tree: object) -> int:
    leaves = tree_leaves(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def head_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 hidden rows, a float32 weight and targets, as training's autocast hands them over."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, DIM, generator=gen).bfloat16()
    weight = 0.02 * torch.randn(PADDED, DIM, generator=gen)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    return hidden, weight, targets


def count_traffic(device: str) -> Traffic:
    """The op body's traffic on `device`'s path: "cpu" runs it; "gpu" counts it on meta
    tensors (shapes only) with the float32-output GEMM that CUDA's probe finds."""
    hidden, weight, targets = head_inputs()
    weight = weight.bfloat16()  # the op body's copy
    if device == "gpu":
        hidden, weight, targets = (t.to("meta") for t in (hidden, weight, targets))
    chunk_rows = LOSS_CHUNK_ELEMENTS // PADDED
    probe = loss.has_float32_output_gemm
    loss.has_float32_output_gemm = lambda device_type: device == "gpu"
    try:
        with (traffic := Traffic()), torch.no_grad():
            loss._chunked_loss(hidden, weight, targets, VOCAB, "sum", True, chunk_rows, True)
    finally:
        loss.has_float32_output_gemm = probe
    return traffic


def main() -> None:
    hidden, weight, targets = head_inputs()
    chunk_rows = LOSS_CHUNK_ELEMENTS // PADDED
    with (body := LiveBytes(hidden, weight, targets)), torch.no_grad():
        loss._chunked_loss(hidden, weight.bfloat16(), targets, VOCAB, "sum", True, chunk_rows, True)
    hidden.requires_grad_()
    weight.requires_grad_()
    with (op := LiveBytes(hidden, weight, targets)), torch.autocast("cpu", dtype=torch.bfloat16):
        fused_loss = fused_linear_cross_entropy(
            hidden, weight, targets, vocab_size=VOCAB, reduction="sum", fp32_logits=True
        )
        fused_loss.backward()
    print(f"## Loss head on CPU: {ROWS} rows, vocab {VOCAB}, d {DIM}, {chunk_rows} rows per chunk")
    print()
    print("| part | peak GiB above inputs |")
    print("|---|---|")
    print(f"| op body: bf16 weight copy + chunk loop | {body.peak / 2**30:.3f} |")
    print(f"| op as autograd runs it: outputs + backward | {op.peak / 2**30:.3f} |")
    print(f"| **head** | **{max(body.peak, op.peak) / 2**30:.3f}** |")
    print()
    print("| op body's path | GEMMs | GEMM GB read + written | other ops | other GB |")
    print("|---|---|---|---|---|")
    for device in ("cpu", "gpu"):
        traffic = count_traffic(device)
        print(f"| {device} | {traffic.ops['GEMM']} | {traffic.bytes['GEMM'] / 1e9:.1f} |", end="")
        print(f" {traffic.ops['other']} | {traffic.bytes['other'] / 1e9:.1f} |")


if __name__ == "__main__":
    main()
