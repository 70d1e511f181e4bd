"""The fused head's memory above its inputs, counted tensor by tensor on CPU.

`LiveBytes` adds up the storages that ops allocate while it is active and subtracts each one
when it is freed: the quantity `torch.cuda.max_memory_allocated` reports on a GPU (bench/
loss_gpu.py), here for a CPU run of the same code. Ops inside a custom op are invisible to it,
so the chunk loop is measured through `_chunked_loss`, the op's body.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nedolm.model import fused_linear_cross_entropy
from nedolm.model.loss import _chunked_loss

ROWS, DIM, VOCAB, PADDED = 512, 64, 4000, 4032
CHUNK_ROWS = 64
SMALL = 64 << 10  # per-row vectors, indices and scalars of one chunk


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages allocated under the mode that are still alive, and their peak;
    the `inputs`' storages (whose views ops return) are not counted."""

    def __init__(self, *inputs: torch.Tensor) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._tracked = {t.untyped_storage().data_ptr() for t in inputs}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._tracked:  # a view of a storage counted already
            return
        self._tracked.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._tracked.discard(key)
        self.live -= size


def head_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 hidden rows and a float32 weight, as training's autocast hands them to the head."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, DIM, generator=gen).bfloat16()
    weight = 0.02 * torch.randn(PADDED, DIM, generator=gen)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    targets[::7] = -100
    return hidden, weight, targets


def test_backward_materialises_no_zeros_for_the_gradient_outputs() -> None:
    """Backward needs only the loss's gradient; zeros shaped like the two saved gradients
    (one of them [W, D] float32) would double the head's peak."""
    hidden, weight, targets = head_inputs()
    hidden.requires_grad_()
    weight.requires_grad_()
    saved_gradients = ROWS * DIM * 2 + PADDED * DIM * 4
    tracker = LiveBytes(hidden, weight, targets)
    with tracker, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(
            hidden, weight, targets, vocab_size=VOCAB, reduction="sum", fp32_logits=True
        )
        loss.backward()
    assert weight.grad is not None and hidden.grad is not None
    assert saved_gradients <= tracker.peak <= saved_gradients + SMALL


def test_a_chunks_temporaries_are_freed_before_the_next_chunk_allocates() -> None:
    """Peak of the chunk loop: the gradients it fills plus one chunk's logits in float32 and
    in bf16 (alive together while cast), or the bf16 logits gradient and the weight gradient's
    bf16 product, whichever is larger; nothing of the previous chunk."""
    hidden, weight, targets = head_inputs()
    weight = weight.bfloat16()
    chunk_fp32, chunk_bf16 = CHUNK_ROWS * PADDED * 4, CHUNK_ROWS * PADDED * 2
    product = PADDED * DIM * 2  # the whole vocabulary is one slice at this size
    bound = PADDED * DIM * 4 + ROWS * DIM * 2 + max(chunk_fp32, chunk_bf16 + product) + chunk_bf16
    tracker = LiveBytes(hidden, weight, targets)
    with tracker, torch.no_grad():
        loss, grad_hidden, grad_weight = _chunked_loss(
            hidden, weight, targets, VOCAB, "sum", True, CHUNK_ROWS, True
        )
    assert ROWS // CHUNK_ROWS == 8 and grad_weight.dtype == torch.float32
    assert torch.isfinite(loss) and grad_hidden.abs().sum() > 0
    assert tracker.peak <= bound + SMALL, (tracker.peak, bound)
