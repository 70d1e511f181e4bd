"""torch.compile of the training model: one warm-up on the training shapes, counted recompiles.

The model's blocks are compiled, each on its own (``MorphTransformer.compile_blocks``): they
share one graph, so the warm-up traces one block instead of unrolling every layer (nedolm-0.8b
compiles in seconds, not a minute), and FSDP's per-block units wrap compiled blocks as
torchtitan's do. The warm-up runs ``forward_backward``, as every step does, on a micro-batch
built by the step's own ``to_micro_batch`` from a loader-shaped batch, so it traces the graph
that training runs: the same shapes and strides, the segment and target counts already
dynamic. Training should then never compile again; dynamo's own counters (frames compiled,
graph breaks) are logged at the end of the warm-up, and each later compilation is logged as a
recompile when it happens.

A warm-up that fails is not always a compile failure: the attention backend can fail on this
machine whatever the compiler does. Such a failure is raised, naming the backend, instead of
falling back to an eager run that would fail the same way at its first step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from nedolm.dist import collect_rank_errors
from nedolm.model import AttentionBackendError, MorphTransformer
from nedolm.train.faults import maybe_inject
from nedolm.train.memory import is_out_of_memory
from nedolm.train.step import MicroBatch, StepSettings, forward_backward, to_micro_batch

log = logging.getLogger(__name__)

SEGMENTS_PER_ROW = 8
"""Conversations per row of the warm-up batch (the count is dynamic: any will do)."""

LONGEST_SEGMENT_SOURCES = ("L['layout'].max_seqlen", "L['max_seqlen']")
"""The longest segment as dynamo names it: in a compiled block's layout, and as the model
forward's argument (for a whole-model ``torch.compile``)."""


def dynamo_counts() -> tuple[int, int]:
    """(frames compiled, graph breaks) in this process so far, from dynamo's counters."""
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"], sum(counters["graph_break"].values())


def inductor_cache_counts() -> tuple[int, int]:
    """(hits, misses) of inductor's graph cache in this process so far: a hit is a graph whose
    kernels were compiled before (by this machine, or by the run's compile cache)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


class _RecompileLog:
    """Logs each compilation after the warm-up: there should be none but the ``expected``
    ones (FSDP makes each block an instance of a new class, which the first step traces once
    more: the warm-up runs before sharding, so that a rank failing it cannot strand the others
    inside a collective)."""

    def __init__(self) -> None:
        self.recompiles = 0
        self.expected = 0
        self.armed = False

    def __call__(self, args: Any = None) -> None:
        trigger = getattr(args, "callback_trigger", None)
        if not self.armed or (trigger is not None and trigger.name != "DYNAMO"):
            return
        if self.expected:
            self.expected -= 1
            log.info("torch.compile traces the blocks once more, now sharded by FSDP")
            return
        self.recompiles += 1
        log.warning(
            "torch.compile recompiled the training model after the warm-up (%d so far); "
            "TORCH_LOGS=recompiles says why",
            self.recompiles,
        )


_RECOMPILES: _RecompileLog | None = None


def _recompile_log() -> _RecompileLog:
    """The process's one recompile logger, registered with dynamo once and re-armed per run."""
    global _RECOMPILES
    if _RECOMPILES is None:
        from torch._dynamo.callback import callback_handler

        _RECOMPILES = _RecompileLog()
        callback_handler.register_start_callback(_RECOMPILES)
    _RECOMPILES.armed = False
    _RECOMPILES.recompiles = _RECOMPILES.expected = 0
    return _RECOMPILES


def trace_longest_segment_dynamically() -> bool:
    """Have every later compile in this process trace ``max_seqlen`` as a symbol.

    It is the micro-batch's longest conversation (the kernel backends size their grids by
    it), so it changes almost every step; dynamo specialises an int argument on its first
    value and recompiles at the first other one. Listed in
    ``torch.compiler.config.dynamic_sources`` (after any sources the user set there or in
    TORCH_COMPILE_DYNAMIC_SOURCES) it is dynamic from the first trace. False where torch
    has no such setting: then the first new value recompiles once (and is logged).
    """
    config = torch.compiler.config
    if not hasattr(config, "dynamic_sources"):
        return False
    sources = [source for source in config.dynamic_sources.split(",") if source]
    missing = [source for source in LONGEST_SEGMENT_SOURCES if source not in sources]
    config.dynamic_sources = ",".join([*sources, *missing])
    return True


def warmup_batch(
    vocab_size: int, micro_batch: int, seq_len: int, eos_id: int, device: torch.device
) -> MicroBatch:
    """A loader-shaped packed batch (``SEGMENTS_PER_ROW`` conversations per row, the second
    half of each trained) turned into a micro-batch exactly as the step turns real ones.

    Uses its own generator so that warming up does not consume the global RNG stream.
    """
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (micro_batch, seq_len + 1), generator=gen)
    tokens[tokens == eos_id] = (eos_id + 1) % vocab_size
    segment = max(2, seq_len // SEGMENTS_PER_ROW)
    cols = torch.arange(seq_len + 1)
    tokens[:, (cols % segment == segment - 1) & (cols < seq_len)] = eos_id
    mask = (cols % segment >= segment // 2).expand(micro_batch, -1).clone()
    mask[:, 0] = False
    return to_micro_batch({"tokens": tokens, "trainable_mask": mask}, device, eos_id)


def compile_and_warm_up(
    model: MorphTransformer,
    settings: StepSettings,
    micro_batch: int,
    seq_len: int,
    *,
    fsdp_after: bool = False,
    **compile_args: Any,
) -> bool:
    """``model.compile_blocks(**compile_args)``, warmed up on every rank. False (on every rank)
    if compiling failed anywhere: the blocks are eager again and the run trains eagerly.
    ``fsdp_after``: FSDP will shard the model, so the first step's one new trace is expected.

    Raises:
        OutOfMemory: on every rank, when the warm-up step did not fit on some rank (its advice
            names the config keys that shrink it).
        AttentionBackendError: on every rank, when the warm-up failed on some rank because of
            the attention backend (or fails eagerly too): no execution mode would train.
    """
    info = settings.info
    recompiles = _recompile_log()
    compile_error = backend_error = memory_error = ""
    try:
        log.info("compile warm-up started (%s, each block on its own)", compile_args)
        started = time.monotonic()
        frames, breaks = dynamo_counts()
        hits, misses = inductor_cache_counts()
        maybe_inject("compile_warmup", info.rank)
        if not trace_longest_segment_dynamically():
            log.info("torch %s cannot trace max_seqlen dynamically", torch.__version__)
        model.compile_blocks(**compile_args)
        model.train()  # the mode whose forwards run the compiled blocks
        mb = warmup_batch(model.cfg.vocab_size, micro_batch, seq_len, settings.eos_id, info.device)
        try:
            forward_backward(model, mb, settings.loss, info.world_size / mb.targets)
        except Exception as exc:  # which one failed: memory, the compiler or the model?
            model.uncompile_blocks()
            if is_out_of_memory(exc):  # an eager retry would need more memory, not less
                memory_error = f"{type(exc).__name__}: {exc}"
            else:
                backend_error = _backend_failure(exc, model, mb, settings)
            raise
        frames_after, breaks_after = dynamo_counts()
        hits_after, misses_after = inductor_cache_counts()
        log.info(
            "compile warm-up done in %.1fs: %d frame(s) compiled, %d graph break(s); "
            "inductor's cache: %d graph(s) found, %d compiled",
            time.monotonic() - started,
            frames_after - frames,
            breaks_after - breaks,
            hits_after - hits,
            misses_after - misses,
        )
        if breaks_after > breaks:
            log.warning("the compiled training forward breaks; TORCH_LOGS=graph_breaks says where")
    except Exception as exc:  # decided together below
        compile_error = f"{type(exc).__name__}: {exc}"
    finally:
        model.zero_grad(set_to_none=True)
    memory_errors = collect_rank_errors(info, memory_error)
    if memory_errors:
        raise settings.memory.error("in the compile warm-up", memory_errors)
    backend_errors = collect_rank_errors(info, backend_error)
    if backend_errors:
        model.uncompile_blocks()
        raise AttentionBackendError(
            f"the attention backend (attn_impl={model.cfg.attn_impl!r}) fails in the "
            "compile warm-up (its own error, or the same step fails eagerly too): not a compile "
            "failure; choose another attn_impl: " + " | ".join(backend_errors)
        )
    errors = collect_rank_errors(info, compile_error)
    if errors:
        model.uncompile_blocks()
        log.warning("torch.compile disabled on every rank: %s", " | ".join(errors))
        return False
    recompiles.expected = int(fsdp_after)
    recompiles.armed = True
    return True


def _backend_failure(
    exc: BaseException, model: MorphTransformer, mb: MicroBatch, settings: StepSettings
) -> str:
    """Why the warm-up failed if not because of the compiler ("" for a compile failure): an
    AttentionBackendError anywhere in the chain, or the same step failing eagerly."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, AttentionBackendError):
            return f"{type(cause).__name__}: {cause}"
        cause = cause.__cause__ or cause.__context__
    model.zero_grad(set_to_none=True)
    try:
        forward_backward(model, mb, settings.loss, settings.info.world_size / mb.targets)
    except Exception as eager_exc:
        return f"{type(eager_exc).__name__}: {eager_exc}"
    return ""
