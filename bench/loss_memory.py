"""The fused loss head's memory above its inputs at bench/loss_gpu.py's shape, counted on CPU.

    python bench/loss_memory.py      # about 30 s on 2 cores

`torch.cuda.max_memory_allocated` is the sum of live tensors' storages at its peak; the
`LiveBytes` counter of packages/nedolm-model/tests/test_loss_memory.py adds up the same on a CPU
run of the same code, so a GPU's figure can be predicted (and a regression found) without one.
Ops inside the custom op are invisible from outside it, so two counts are taken: the op's body
(its bf16 copy of the weight and the chunk loop) and the op as autograd runs it (its outputs and
backward); the head's peak is the larger. The H200 measured 0.40 GiB for the head whose counts
here were 0.388 and 0.404 GiB.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages/nedolm-model/tests"))
from test_loss_memory import LiveBytes

from nedolm.model import fused_linear_cross_entropy
from nedolm.model.loss import LOSS_CHUNK_ELEMENTS, _chunked_loss

ROWS, VOCAB, PADDED, DIM = 6553, 32003, 32064, 1536  # 40% of 4 x 4096 positions


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, DIM, generator=gen).bfloat16()
    weight = 0.02 * torch.randn(PADDED, DIM, generator=gen)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    with (body := LiveBytes(hidden, weight, targets)), torch.no_grad():
        chunk_rows = LOSS_CHUNK_ELEMENTS // PADDED
        _chunked_loss(hidden, weight.bfloat16(), targets, VOCAB, False, True, chunk_rows, True)
    hidden.requires_grad_()
    weight.requires_grad_()
    with (op := LiveBytes(hidden, weight, targets)), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(
            hidden, weight, targets, vocab_size=VOCAB, reduction="sum", fp32_logits=True
        )
        loss.backward()
    print(f"## Loss head memory above inputs, counted on CPU: {ROWS} rows, vocab {VOCAB}, d {DIM}")
    print()
    print("| part | peak GiB |")
    print("|---|---|")
    print(f"| op body: bf16 weight copy + chunk loop | {body.peak / 2**30:.3f} |")
    print(f"| op as autograd runs it: outputs + backward | {op.peak / 2**30:.3f} |")
    print(f"| **head** | **{max(body.peak, op.peak) / 2**30:.3f}** |")


if __name__ == "__main__":
    main()
