"""The fused loss head against Liger's fused linear cross-entropy and the naive head (run by
bench/gpu.sh): time of forward + backward and peak memory above the inputs.

    python bench/loss_gpu.py [--device cpu --rows 512 --vocab 1000 --dim 64] [--repeats 5]

Defaults are the issue's shape: 4 x 4096 positions, 40% targets, vocab 32003 (padded to 32064
rows), d_model 1536, bf16 autocast over float32 weights, as training runs the head. Every head
scores the same selected target rows; Liger (`liger-kernel`, a bench-only reference, never a
dependency) is measured only when importable, on CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nedolm.model import fused_linear_cross_entropy
from nedolm.model.loss import LOSS_CHUNK_ELEMENTS, has_float32_output_gemm

TARGET_FRACTION = 0.4


def naive(hidden, weight, targets, vocab: int) -> torch.Tensor:
    logits = F.linear(hidden, weight[:vocab])
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def ours(hidden, weight, targets, vocab: int, chunk_elements=LOSS_CHUNK_ELEMENTS) -> torch.Tensor:
    return fused_linear_cross_entropy(
        hidden,
        weight,
        targets,
        vocab_size=vocab,
        reduction="sum",
        fp32_logits=True,
        chunk_elements=chunk_elements,
    )


def ours_half_chunks(hidden, weight, targets, vocab: int) -> torch.Tensor:
    """The same head with chunks half the default: ~0.035 GiB less at the issue's shape, twice
    the launches; which way the default should move is the GPU's call (issue 24, item 5)."""
    return ours(hidden, weight, targets, vocab, chunk_elements=LOSS_CHUNK_ELEMENTS // 2)


def liger() -> Callable | None:
    """Liger's head as a function of the same arguments, or None when it is not installed."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")

    def head(hidden, weight, targets, vocab: int) -> torch.Tensor:
        # Liger takes the weight in the input's dtype (what autocast would hand a linear).
        return loss(weight[:vocab].to(hidden.dtype), hidden, targets)

    return head


def loss_and_grads(head: Callable, inputs: tuple, args: argparse.Namespace) -> list[torch.Tensor]:
    """[loss, d hidden, d weight] of one forward + backward, as training's autocast runs it."""
    hidden, weight, targets = inputs
    with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
        loss = head(hidden, weight, targets, args.vocab)
    loss.backward()
    results = [loss.detach().float(), hidden.grad.float(), weight.grad.float()]
    hidden.grad = weight.grad = None
    return results


def float32_reference(inputs: tuple, args: argparse.Namespace) -> list[torch.Tensor]:
    """The same head in float32 from the same (bf16-rounded) inputs: what every head is
    compared with, so that a head's error reads next to the naive bf16 head's."""
    hidden, weight, targets = inputs
    hidden32 = hidden.detach().float().requires_grad_()
    weight32 = weight.detach().to(hidden.dtype).float().requires_grad_()
    loss = F.cross_entropy(hidden32 @ weight32[: args.vocab].T, targets, reduction="sum")
    loss.backward()
    return [loss.detach(), hidden32.grad, weight32.grad]


def relative_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[float, float]:
    """(loss, worst gradient) relative error, as L2 norms."""
    errors = [
        float((g - w).norm() / w.norm().clamp_min(1e-30)) for g, w in zip(got, want, strict=True)
    ]
    return errors[0], max(errors[1:])


def measure(head: Callable, inputs: tuple, args: argparse.Namespace) -> tuple[float, float]:
    """(median ms of forward + backward, peak GiB above the inputs: 0 off CUDA)."""
    hidden, weight, targets = inputs
    on_cuda = args.device == "cuda"

    def step() -> None:
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=on_cuda):
            head(hidden, weight, targets, args.vocab).backward()
        hidden.grad = weight.grad = None

    step()
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if on_cuda else 0
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        step()
        if on_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if on_cuda else 0.0
    return 1e3 * statistics.median(times), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=4 * 4096, help="positions of a micro-batch")
    parser.add_argument("--vocab", type=int, default=32003)
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    n_targets = int(args.rows * TARGET_FRACTION)
    padded = -(-args.vocab // 64) * 64
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    hidden = torch.randn(n_targets, args.dim, generator=gen).to(args.device, dtype)
    weight = (0.02 * torch.randn(padded, args.dim, generator=gen)).to(args.device)
    targets = torch.randint(0, args.vocab, (n_targets,), generator=gen).to(args.device)
    inputs = (hidden.requires_grad_(), weight.requires_grad_(), targets)
    heads: dict[str, Callable | None] = {
        "nedolm fused": ours,
        "nedolm fused, half chunks": ours_half_chunks,
        "naive": naive,
        "liger": liger(),
    }
    print(f"## Loss head: {n_targets} target rows of {args.rows}, vocab {args.vocab}, ", end="")
    print(f"d {args.dim}, {dtype} hidden, float32 weight, {args.device}\n")
    reference = float32_reference(inputs, args)
    rounded = "bf16-rounded " if dtype == torch.bfloat16 else ""
    print(f"Errors: relative to the same head in float32 from the same {rounded}inputs.")
    if dtype == torch.float32:  # the head's gradients are float32 too: add_weight_grad's addmm_
        print("nedolm's weight gradient: one float32 GEMM per chunk, added in place.\n")
    elif has_float32_output_gemm(args.device):
        print("nedolm's bf16 weight gradient: one GEMM per chunk adding into float32 in place.\n")
    else:
        print("nedolm's bf16 weight gradient: bf16 product slices (no float32-output GEMM).\n")
    print("| head | fwd+bwd ms | peak GiB above inputs | ms / nedolm fused | loss error |", end="")
    print(" worst gradient error |")
    print("|---|---|---|---|---|---|")
    results = {}
    for name, head in heads.items():
        if head is None or (name == "liger" and args.device != "cuda"):
            why = "not installed" if head is None else "needs CUDA"
            print(f"| {name} | skipped: {why} | | | | |")
            continue
        try:
            loss_error, grad_error = relative_errors(loss_and_grads(head, inputs, args), reference)
            results[name] = measure(head, inputs, args)
        except Exception as exc:  # a reference that fails here must not hide the others
            print(f"| {name} | error: {type(exc).__name__}: {str(exc)[:160]} | | | | |")
            continue
        ms, peak = results[name]
        peak_text = f"{peak:.2f}" if args.device == "cuda" else "n/a (CPU)"
        ratio = ms / results["nedolm fused"][0]
        print(f"| {name} | {ms:.1f} | {peak_text} | {ratio:.2f} | {loss_error:.1e} |", end="")
        print(f" {grad_error:.1e} |", flush=True)
    print()


if __name__ == "__main__":
    main()
