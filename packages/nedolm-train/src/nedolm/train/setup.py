"""Everything before the first step: contract, data plan, model, compile, DDP/FSDP, loaders,
resume.

``prepare_run`` turns an ``SFTConfig`` into a ready ``Run``. Each stage is a small function, and
every stage that can fail on one rank goes through ``main_rank_call`` (rank-0 work: contract
hashing, base checkpoint read, metadata) or ``all_rank_call`` (local work on every rank), so a
failure anywhere is raised everywhere and no rank is left waiting in a collective.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nedolm.data.atomic import atomic_write_bytes
from nedolm.data.contract import (
    audited_seq_len,
    read_validation_sources,
    validate_dataset_contract,
)
from nedolm.data.loader import SFTLoader, build_sft_loader
from nedolm.data.packing import PlannedShard, discover_sft_shards
from nedolm.data.roles import validate_roles
from nedolm.data.stats import corpus_stats
from nedolm.dist import (
    ON_MAIN_RANK,
    DistInfo,
    all_rank_call,
    broadcast_module_state,
    is_distributed,
    main_rank_call,
)
from nedolm.model import (
    AttentionBackendError,
    ModelConfig,
    MorphTransformer,
    build_model,
    resolve_attn_impl,
)
from nedolm.train.async_save import StagedCopies
from nedolm.train.audit import BatchAudit
from nedolm.train.base import (
    base_run_config,
    check_base_tokenizer,
    load_base_weights,
    model_config,
)
from nedolm.train.checkpoint import resume_checkpoint, write_run_metadata
from nedolm.train.compile_cache import load_compile_cache
from nedolm.train.compiling import compile_and_warm_up
from nedolm.train.config import RunConfig, SFTConfig, to_builtins
from nedolm.train.contract import (
    ELASTIC_FREE,
    FREE_ON_RESUME,
    check_plan_matches_audit,
    check_resume,
    execution_mode,
    fingerprint,
    split_train_val,
    training_contract,
)
from nedolm.train.memory import memory_advice
from nedolm.train.optim import build_optimizer
from nedolm.train.parallel import is_sharded, parallelize
from nedolm.train.precision import COMPUTE_DTYPES, ComputePrecision, resolve_precision
from nedolm.train.state import TrainState, read_checkpoint
from nedolm.train.step import LossOptions, StepSettings

log = logging.getLogger(__name__)

RESOLVED_CONFIG_FILE = "config.resolved.json"


@dataclass
class Run:
    """A prepared run: what the loop needs, nothing more."""

    cfg: SFTConfig
    info: DistInfo
    seq_len: int
    max_steps: int
    steps_per_epoch: float
    """Optimizer steps of one pass over the training windows (the global batch into them)."""
    state: TrainState
    """Bare model, optimizer, progress, loader: what a checkpoint saves and restores."""
    model: nn.Module
    """What the step calls: ``state.model`` DDP-wrapped, or itself (FSDP shards it in place; its
    blocks run compiled in training mode when ``execution.effective_compile``)."""
    settings: StepSettings
    train_batches: Iterator[dict[str, torch.Tensor]]
    """Infinite iterator over ``state.loader``."""
    val_loader: SFTLoader | None
    val_sources: dict[int, str]
    """The input each validation shard holds (``prepare --val-input``), read once at start:
    every validation on every rank groups its loss by the same names."""
    contract: dict[str, dict[str, Any]]
    """{"dataset", "training", "execution"}: stored in every checkpoint."""
    base_checkpoint: str
    audit: BatchAudit | None = None
    """Set by NEDOLM_AUDIT_DIR: records the windows each step trained."""
    staged: StagedCopies = field(default_factory=StagedCopies)
    """Rank 0's CPU buffers for asynchronous checkpoints (``_reserve_staging``)."""

    @property
    def eos_id(self) -> int:
        return self.settings.eos_id


@dataclass
class _Data:
    contract: dict[str, Any]
    train_shards: list
    val_shards: list
    stats: dict[str, Any]
    val_stats: dict[str, Any] | None


def prepare_run(
    cfg: SFTConfig,
    info: DistInfo,
    *,
    smoke_steps: int | None = None,
    allow_compile: bool = True,
    staged: StagedCopies | None = None,
) -> Run:
    """Check everything, build everything, and restore the latest checkpoint if there is one.

    ``staged``: the async-checkpoint buffers, which rank 0 starts reserving in the background
    before the compile warm-up; its owner waits for that (``wait_for_reserve``) before the
    job tears anything down, also when this raises.
    """
    run_config = all_rank_call(info, "read base config", lambda: base_run_config(cfg))
    model_cfg = all_rank_call(
        info,
        "build model config",
        lambda: model_config(
            run_config, morph_dispatch=cfg.train.morph_dispatch, attn_impl=cfg.train.attn_impl
        ),
    )
    corpus_seq_len = all_rank_call(
        info, "read corpus seq_len", lambda: audited_seq_len(cfg.data_dir)
    )
    seq_len = cfg.train.seq_len or corpus_seq_len
    compute = all_rank_call(
        info, "resolve precision", lambda: resolve_precision(cfg.train.precision, info.device)
    )
    all_rank_call(
        info,
        "check runtime",
        lambda: _check_runtime(cfg, model_cfg, seq_len, corpus_seq_len, info.device, compute),
    )
    main_rank_call(info, "check corpus tokenizer", lambda: check_base_tokenizer(cfg, run_config))
    data = _prepare_data(cfg, info, run_config, model_cfg, seq_len)
    steps_per_epoch = _steps_per_epoch(cfg, info, data.stats)
    epochs_steps = max(1, math.ceil(cfg.train.num_epochs * steps_per_epoch))
    _check_profile_window(cfg, cfg.train.max_steps or epochs_steps)
    max_steps = smoke_steps or cfg.train.max_steps or epochs_steps
    _log_schedule(cfg, info, max_steps, steps_per_epoch)
    recipe = _recipe(cfg, model_cfg, max_steps)
    contract = {
        "dataset": data.contract,
        "training": training_contract(
            data.contract["fingerprint"],
            seq_len,
            _val_ids(cfg, data.contract["validation_shard_ids"]),
            recipe,
        ),
    }

    torch.manual_seed(cfg.train.seed)
    # No random draws (seconds for nedolm-0.8b, on every rank): rank 0 loads every weight from
    # the base below and broadcasts them, or every rank loads them from the checkpoint. Built
    # on the rank's device: no host copy to move there.
    base_model = all_rank_call(
        info,
        "build model",
        lambda: build_model(model_cfg, init_weights=False, device=info.device),
    )
    base_model.grad_checkpoint = cfg.train.grad_checkpoint
    resume_path = main_rank_call(
        info,
        "find latest SFT checkpoint",
        lambda: resume_checkpoint(cfg.run_dir, trust_unverified=cfg.train.trust_unverified),
    )
    free = (*FREE_ON_RESUME, *ELASTIC_FREE) if cfg.train.elastic else FREE_ON_RESUME
    if resume_path is not None:
        resume = all_rank_call(
            info, "load SFT checkpoint", lambda: _read_resume(resume_path, contract, free)
        )
        base_checkpoint = str(resume.get("base_checkpoint", ""))
    else:
        resume = None
        base_checkpoint = str(
            main_rank_call(info, "load base checkpoint", lambda: _load_base(cfg, base_model))
        )
    # Fresh runs read the base on rank 0 only; resumed ranks load the same file below.
    broadcast_module_state(base_model)

    settings = StepSettings(
        info=info,
        eos_id=run_config.eos_id,
        grad_accum_steps=cfg.train.grad_accum_steps,
        grad_clip=cfg.optim.grad_clip,
        loss=LossOptions(
            assistant_only_head=cfg.train.assistant_only_head,
            loss_fp32_logits=cfg.train.loss_fp32_logits,
            use_amp=compute == "bf16",
        ),
        memory=memory_advice(cfg, seq_len, info.world_size),
    )
    staged = StagedCopies() if staged is None else staged
    _reserve_staging(staged, cfg, info, base_model)  # while the compile warm-up runs
    effective_compile = _maybe_compile(base_model, cfg, seq_len, settings, allow_compile)
    contract["execution"] = execution_mode(
        world_size=info.world_size,
        num_workers=cfg.train.num_workers,
        effective_compile=effective_compile,
        parallelism=cfg.train.parallelism,
        elastic=cfg.train.elastic,
    )
    if resume is not None:
        all_rank_call(
            info,
            "check resume execution mode",
            lambda: check_resume(
                resume, contract, str(resume_path), parts=("execution",), free=free
            ),
        )
    model = _parallelize(base_model, cfg, info, compute)

    optimizer = all_rank_call(
        info, "build optimizer", lambda: build_optimizer(base_model, cfg.optim)
    )
    train_loader, val_loader = all_rank_call(
        info, "build data loaders", lambda: _build_loaders(cfg, info, seq_len, data)
    )
    val_sources = all_rank_call(
        info, "read validation sources", lambda: read_validation_sources(cfg.data_dir)
    )
    state = TrainState(base_model, optimizer, train_loader)
    audit = BatchAudit.from_env(train_loader, info.rank)
    if resume is not None:
        _restore(state, resume, resume_path, info, elastic=cfg.train.elastic)
        log.info("resuming from %s at step %d", resume_path, state.progress.step)
        del resume
    run = Run(
        cfg=cfg,
        info=info,
        seq_len=seq_len,
        max_steps=max_steps,
        steps_per_epoch=steps_per_epoch,
        state=state,
        model=model,
        settings=settings,
        train_batches=audit.track(iter(train_loader)) if audit else iter(train_loader),
        audit=audit,
        val_loader=val_loader,
        val_sources=val_sources,
        contract=contract,
        base_checkpoint=base_checkpoint,
        staged=staged,
    )
    main_rank_call(info, "write run metadata", lambda: _write_metadata(run, data))
    return run


def _check_runtime(
    cfg: SFTConfig,
    model_cfg: ModelConfig,
    seq_len: int,
    corpus_seq_len: int,
    device: torch.device,
    compute: ComputePrecision,
) -> None:
    """Refuse a seq_len the model or the corpus cannot train at, or an attention backend that
    cannot train here in the run's compute dtype, saying what to change; log a backend the
    configs name."""
    longest = model_cfg.max_seq_len
    if seq_len > longest:
        fix = (
            f"drop train.seq_len to train at the corpus's seq_len={corpus_seq_len}"
            if corpus_seq_len <= longest
            else f"prepare the corpus again with --seq-len {longest} or less"
        )
        raise ValueError(
            f"train.seq_len={seq_len} exceeds the model's max_seq_len={longest}: {fix}"
        )
    if seq_len != corpus_seq_len:
        raise ValueError(
            f"train.seq_len={seq_len} but the corpus {cfg.data_dir} was prepared at "
            f"seq_len={corpus_seq_len}: drop train.seq_len (it defaults to the corpus's) or "
            f"prepare the corpus again with --seq-len {seq_len}"
        )
    # Packed rows are only correct with segment isolation; refuse a backend that cannot run.
    source = (
        "train.attn_impl"
        if cfg.train.attn_impl is not None
        else f"the base model's config ({cfg.base_config or cfg.base_hf_dir})"
    )
    try:
        resolve_attn_impl(model_cfg.attn_impl, device, COMPUTE_DTYPES[compute])
    except AttentionBackendError as err:
        raise AttentionBackendError(
            f"{err}. It is set by {source}; `train.attn_impl: auto` takes the first backend "
            "that trains here"
        ) from err
    if model_cfg.attn_impl != "auto":  # auto logs its own choice and why
        log.info("attn_impl %s, set by %s (its start-up probe passed)", model_cfg.attn_impl, source)


def _check_profile_window(cfg: SFTConfig, max_steps: int) -> None:
    """Refuse a profile window the configured run never reaches: a misjudged step count, not a
    silent run without the profile asked for. ``max_steps`` is the configured run's, so a
    ``--smoke-steps`` check of the config is not refused for a window beyond its few steps."""
    start = cfg.profile.start_step
    if start > max_steps:
        raise ValueError(
            f"profile.start_step={start} is past the run's last step, {max_steps}: profile a "
            "step the run reaches (0: no profile)"
        )


def _val_ids(cfg: SFTConfig, held_out: Sequence[int]) -> list[int]:
    """The shards validated: the configured ids, or by default the corpus's held-out ones."""
    if not cfg.validation.enabled:
        return []
    ids = cfg.validation.shard_ids
    return list(held_out if ids is None else ids)


def split_corpus(
    cfg: SFTConfig, shards: list[PlannedShard], held_out: Sequence[int]
) -> tuple[list[PlannedShard], list[PlannedShard]]:
    """(train, validation): the corpus's planned ``shards`` as the run of ``cfg`` uses them.

    ``held_out``: the corpus's held-out shard ids (its manifest's ``validation_shard_ids``).
    Public so that a benchmark can time the very micro-batches the trainer draws.
    """
    return split_train_val(
        shards,
        _val_ids(cfg, held_out),
        held_out,
        train_on_held_out=cfg.validation.train_on_held_out,
    )


def _prepare_data(
    cfg: SFTConfig, info: DistInfo, run_config: RunConfig, model_cfg: ModelConfig, seq_len: int
) -> _Data:
    def check_contract() -> dict[str, Any]:
        contract = validate_dataset_contract(cfg.data_dir, model_cfg.vocab_size, seq_len)
        if int(contract["eos_id"]) != run_config.eos_id:
            raise RuntimeError(
                f"corpus EOS id {contract['eos_id']} != base model eos_id {run_config.eos_id} "
                f"({cfg.base_config or cfg.base_hf_dir})"
            )
        return contract

    contract = main_rank_call(info, "validate dataset contract", check_contract)

    def plan() -> _Data:
        shards = discover_sft_shards(cfg.data_dir, seq_len)
        check_plan_matches_audit(corpus_stats(shards, seq_len), contract)
        train, val = split_corpus(cfg, shards, contract["validation_shard_ids"])
        val_stats = corpus_stats(val, seq_len) if val else None
        return _Data(contract, train, val, corpus_stats(train, seq_len), val_stats)

    data = all_rank_call(info, "recompute packing plan", plan)
    roles = main_rank_call(
        info,
        "audit roles",
        lambda: {
            "train": validate_roles(data.train_shards),
            "val": validate_roles(data.val_shards),
        },
    )
    stats = data.stats
    log.info(
        "train: %d shards, %d windows, %d raw tokens, valid context %.2f%%, targets %.2f%%",
        stats["shards"],
        stats["windows"],
        stats["raw_tokens"],
        100 * stats["valid_context_ratio"],
        100 * stats["assistant_target_ratio"],
    )
    log.info(
        "shards: train %s, validate %s, held out by the corpus %s",
        [s.shard_id for s in data.train_shards],
        [s.shard_id for s in data.val_shards],
        data.contract["validation_shard_ids"],
    )
    log.info("roles: %s", roles)
    if data.val_stats is not None:
        log.info(
            "validation: shards %s, %d windows",
            _val_ids(cfg, data.contract["validation_shard_ids"]),
            data.val_stats["windows"],
        )
    return data


def _global_batch(cfg: SFTConfig, info: DistInfo) -> int:
    return cfg.train.micro_batch_size * cfg.train.grad_accum_steps * info.world_size


def _steps_per_epoch(cfg: SFTConfig, info: DistInfo, stats: dict[str, Any]) -> float:
    return int(stats["windows"]) / _global_batch(cfg, info)


def _log_schedule(cfg: SFTConfig, info: DistInfo, max_steps: int, steps_per_epoch: float) -> None:
    t = cfg.train
    log.info(
        "schedule: %d steps = %.2f epochs; global batch %d windows (micro %d x accum %d x "
        "%d ranks), %.2f steps per epoch",
        max_steps,
        max_steps / steps_per_epoch,
        _global_batch(cfg, info),
        t.micro_batch_size,
        t.grad_accum_steps,
        info.world_size,
        steps_per_epoch,
    )
    warmup = cfg.optim.warmup_for(max_steps)
    if warmup >= max_steps:
        log.warning(
            "warm-up of %d steps is as long as the run (%d steps): the lr never leaves the "
            "warm-up ramp; lower optim.warmup_steps or give optim.warmup_ratio (e.g. 0.05)",
            warmup,
            max_steps,
            extra=ON_MAIN_RANK,
        )


def _recipe(cfg: SFTConfig, model_cfg: ModelConfig, max_steps: int) -> dict[str, Any]:
    t = cfg.train
    return {
        "max_steps": max_steps,
        "micro_batch_size": t.micro_batch_size,
        "grad_accum_steps": t.grad_accum_steps,
        "seed": t.seed,
        "grad_checkpoint": t.grad_checkpoint,
        "assistant_only_head": t.assistant_only_head,
        "loss_fp32_logits": t.loss_fp32_logits,
        "compile_requested": t.compile,
        "compile_mode": t.compile_mode,
        "compile_backend": t.compile_backend,
        "optim": _optim_recipe(cfg),
        "model_config": dataclasses.asdict(model_cfg),
    }


def _optim_recipe(cfg: SFTConfig) -> dict[str, Any]:
    """The optimizer settings as the contract records them: an unset ``warmup_steps`` as the
    number it stands for, and no ``warmup_ratio`` unless one is used, so that a run stores the
    same recipe as one written before ``warmup_ratio`` existed."""
    optim = to_builtins(cfg.optim)
    if cfg.optim.warmup_ratio is None:
        del optim["warmup_ratio"]
        optim["warmup_steps"] = cfg.optim.warmup_for(0)  # independent of the run's length
    return optim


def _read_resume(
    path: Path, contract: dict[str, dict[str, Any]], free: tuple[str, ...]
) -> dict[str, Any]:
    """The checkpoint to resume from, in the current format, refused if the recipe changed.

    A finished run may be extended: a larger ``train.max_steps`` and nothing else changed.
    The schedule then keeps its span (``Progress.schedule_steps``), so the added steps train at
    the learning rate the finished run ended with rather than jumping back up a new curve.
    """
    state = read_checkpoint(path, verify=False)  # latest_checkpoint verified it just now
    saved = state.get("contract")
    recipe = saved.get("training", {}).get("recipe", {}) if isinstance(saved, dict) else {}
    saved_steps = int(recipe.get("max_steps", -1))
    wanted_steps = int(contract["training"]["recipe"]["max_steps"])
    finished = int(state.get("progress", {}).get("step", -2)) == saved_steps
    extended = finished and wanted_steps > saved_steps
    if extended:
        free = (*free, "training.recipe.max_steps")
    hints = {}
    if state.get("progress", {}).get("schedule_steps"):  # written by an extended run
        hints["training.recipe.max_steps"] = (
            f"this run was extended to {saved_steps} steps: continue it with "
            f"--set train.max_steps={saved_steps} (or train.max_steps: {saved_steps} in the config)"
        )
    check_resume(state, contract, str(path), parts=("dataset", "training"), free=free, hints=hints)
    if extended:
        progress = state["progress"]
        progress["schedule_steps"] = progress.get("schedule_steps") or saved_steps
        log.info(
            "extending the finished run: steps %d -> %d, a new stage; the added steps keep the "
            "lr the schedule over %d steps ended with",
            saved_steps,
            wanted_steps,
            progress["schedule_steps"],
        )
    return state


def _restore(
    state: TrainState, resume: dict[str, Any], path: Path, info: DistInfo, *, elastic: bool
) -> None:
    """Load the checkpoint into ``state``: collectively when shards move between ranks."""
    if path.is_dir():
        state.load_sharded(path, resume, info.rank, elastic=elastic)
    elif is_sharded(state.model):
        state.load_state_dict(resume, info.rank, elastic=elastic)
    else:
        all_rank_call(
            info,
            "restore training state",
            lambda: state.load_state_dict(resume, info.rank, elastic=elastic),
        )


def _parallelize(
    base_model: MorphTransformer, cfg: SFTConfig, info: DistInfo, compute: ComputePrecision
) -> nn.Module:
    """DDP wraps the model (its blocks compiled or not); FSDP shards it in place, each block
    a unit whose compiled wrapper keeps calling the sharded block."""
    t = cfg.train
    return parallelize(
        base_model,
        t.parallelism,
        device=info.device,
        compute=compute,
        ddp_bucket_cap_mb=t.ddp_bucket_cap_mb,
        ddp_static_graph=t.ddp_static_graph,
    )


def _load_base(cfg: SFTConfig, model: nn.Module) -> Path:
    path = load_base_weights(cfg, model)
    log.info("starting from base checkpoint %s (its optimizer/data state is not used)", path)
    return path


def _reserve_staging(
    staged: StagedCopies, cfg: SFTConfig, info: DistInfo, base_model: nn.Module
) -> None:
    """Rank 0 (the writer of unsharded checkpoints) reserves its staging buffers now, so the
    first checkpoint's pause is a copy, not an allocation, and the allocation overlaps the
    compile warm-up rather than training steps. AdamW's two moments do not exist before its
    first step; each is shaped like its parameter."""
    if cfg.train.async_checkpoint and cfg.train.parallelism != "fsdp" and info.is_main:
        trainable = [p for p in base_model.parameters() if p.requires_grad]
        staged.reserve(base_model.state_dict(), trainable, trainable)


def _maybe_compile(
    base_model: MorphTransformer,
    cfg: SFTConfig,
    seq_len: int,
    settings: StepSettings,
    allow_compile: bool,
) -> bool:
    """Compile the blocks and warm up on every rank (``compile_and_warm_up``), with the run's
    compile cache loaded first (``compile_cache``); if any rank fails to compile, every rank
    runs eagerly. True when the blocks run compiled.

    Runs before DDP so that a failed warm-up cannot strand a rank inside a DDP collective, and
    so that all ranks share one execution mode.
    """
    if not (cfg.train.compile and allow_compile):
        return False
    if cfg.train.compile_cache:
        load_compile_cache(cfg.run_dir)
    return compile_and_warm_up(
        base_model,
        settings,
        cfg.train.micro_batch_size,
        seq_len,
        fsdp_after=cfg.train.parallelism == "fsdp" and is_distributed(),
        mode=cfg.train.compile_mode,
        backend=cfg.train.compile_backend,
    )


def _build_loaders(
    cfg: SFTConfig,
    info: DistInfo,
    seq_len: int,
    data: _Data,
) -> tuple[SFTLoader, SFTLoader | None]:
    t, v = cfg.train, cfg.validation
    train_loader, _ = build_sft_loader(
        data_dir=cfg.data_dir,
        seq_len=seq_len,
        micro_batch_size=t.micro_batch_size,
        rank=info.rank,
        world_size=info.world_size,
        num_workers=t.num_workers,
        prefetch_factor=t.prefetch_factor,
        seed=t.seed,
        shards=data.train_shards,
        persistent_workers=t.persistent_workers,
    )
    val_loader = None
    if data.val_shards:
        val_loader, _ = build_sft_loader(
            data_dir=cfg.data_dir,
            seq_len=seq_len,
            micro_batch_size=v.micro_batch_size or t.micro_batch_size,
            rank=info.rank,
            world_size=info.world_size,
            num_workers=v.num_workers if v.num_workers is not None else min(2, t.num_workers),
            prefetch_factor=t.prefetch_factor,
            seed=v.seed,
            shards=data.val_shards,
            persistent_workers=False,
        )
    return train_loader, val_loader


def _write_metadata(run: Run, data: _Data) -> None:
    resolved = {
        "sft_config": to_builtins(run.cfg),
        "seq_len": run.seq_len,
        "max_steps": run.max_steps,
        "world_size": run.info.world_size,
        "base_checkpoint": run.base_checkpoint,
        "corpus_stats": data.stats,
        "validation_stats": data.val_stats,
        "contract": run.contract,
        "fingerprints": {k: fingerprint(v) for k, v in run.contract.items()},
    }
    text = json.dumps(resolved, indent=2, ensure_ascii=False, default=str) + "\n"
    atomic_write_bytes(run.cfg.run_dir / RESOLVED_CONFIG_FILE, text.encode())
    write_run_metadata(
        run.cfg.run_dir,
        {
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "start_step": run.state.progress.step,
            "world_size": run.info.world_size,
            "job_id": os.environ.get("SLURM_JOB_ID", ""),
            "nodes": os.environ.get("SLURM_JOB_NODELIST", ""),
            "base_checkpoint": run.base_checkpoint,
            "effective_compile": run.contract["execution"]["effective_compile"],
            "precision": "bf16" if run.settings.loss.use_amp else "fp32",  # as resolved
            "max_steps": run.max_steps,
            "schedule_steps": run.state.progress.schedule_steps or run.max_steps,
            "torch": torch.__version__,
        },
    )
