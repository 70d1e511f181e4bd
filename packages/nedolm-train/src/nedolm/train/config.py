"""Typed configs of an SFT run, loaded strictly from YAML.

Three documents meet here: the SFT YAML (``SFTConfig``: where the run, the base model and the
data live, plus the ``optim``/``train``/``validation`` recipe), the pretraining run's config
(``RunConfig``: the model config as a plain dict, the EOS id) and ``OptimConfig``. Every struct
forbids unknown fields, so a typo is an error naming the key and the file, never a silently
ignored knob. Relative paths resolve against the directory of the YAML that holds them, so a
config works from any current directory. Every default is documented in ``examples/sft.yaml``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
import yaml

from nedolm.data.contract import CONTRACT_FILES
from nedolm.train.config_schema import OverrideError, apply_overrides, explain

Schedule = Literal["cosine", "linear", "wsd", "constant"]
DEFAULT_WARMUP_STEPS = 100
PRECISION_ALIASES = {"bfloat16": "bf16", "float32": "fp32"}
"""torch's dtype names, accepted where the config says bf16/fp32 (as ``export --dtype``)."""
_S = TypeVar("_S", bound=msgspec.Struct)
CHAT_SUFFIXES = (".jsonl", ".json", ".gz", ".zst", ".parquet")
"""What ``prepare`` reads: found in a data_dir, they say it was never prepared."""


class ConfigError(ValueError):
    """A config file is missing, unparsable, or holds an unknown or invalid key."""


def _require(ok: bool, key: str, allowed: str, value: object) -> None:
    """Refuse a value of the dotted config ``key`` unless ``ok`` (written so NaN fails)."""
    if not ok:
        raise ValueError(f"{key} must be {allowed}, got {value!r}")


def _require_fraction(key: str, value: float) -> None:
    _require(0.0 <= value <= 1.0, key, "in [0, 1]", value)


def _require_torch_choice(
    key: str, value: str, default: str, choices: Callable[[], list[str]]
) -> None:
    """Refuse a value torch does not offer: torch.compile would fail in the warm-up, and the run
    would go on uncompiled. torch is imported only for a value other than the default."""
    if value == default:
        return
    import torch

    known = sorted(choices())
    if value not in known:
        close = difflib.get_close_matches(value, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"`{key}`: {value!r} is not one of torch {torch.__version__}'s: "
            f"{', '.join(known)}{hint}"
        )


def _compile_modes() -> list[str]:
    """The installed torch's compile modes but those that capture CUDA graphs."""
    import torch._inductor

    modes = torch._inductor.list_mode_options()
    return [mode for mode, options in modes.items() if not options.get("triton.cudagraphs")]


def _compile_backends() -> list[str]:
    import torch._dynamo

    return torch._dynamo.list_backends(exclude_tags=())


def _refuse_cuda_graphs(mode: str, backend: str) -> None:
    """Refuse the compile modes and the backend that capture CUDA graphs.

    torch records a new CUDA graph for each distinct input size (its CUDAGraph trees key a graph
    on the graph's integer inputs), and the compiled blocks take the segment count and the
    longest segment as such inputs: they change with nearly every micro-batch, so the run would
    record graphs instead of replaying them, step after step. Not measured on a GPU: read from
    torch's ``cudagraph_trees`` (2.13), whose own warning says as much past 8 sizes.
    """
    if backend == "cudagraphs":
        raise ValueError(
            "`train.compile_backend`: 'cudagraphs' records a CUDA graph for each distinct input "
            "size, and the segment count and longest segment change with nearly every "
            "micro-batch: use 'inductor'"
        )
    if mode == "default":
        return
    import torch._inductor

    modes = torch._inductor.list_mode_options()
    if modes.get(mode, {}).get("triton.cudagraphs"):
        instead = f"{mode}-no-cudagraphs" if f"{mode}-no-cudagraphs" in modes else "default"
        raise ValueError(
            f"`train.compile_mode`: {mode!r} captures CUDA graphs, which torch records anew for "
            "each distinct input size, and the segment count and longest segment change with "
            f"nearly every micro-batch: use {instead!r}"
        )


class OptimConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """AdamW and learning-rate schedule settings."""

    lr: float = 2e-5
    """Peak learning rate, reached at the end of warm-up."""
    min_lr_ratio: float = 0.1
    """The schedule decays to ``lr * min_lr_ratio`` (cosine, linear, wsd)."""
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_norms_and_embeddings: bool = False
    """Apply weight decay to norm gains and embeddings too (off: they are not decayed)."""
    grad_clip: float = 1.0
    """Max global gradient norm; a non-finite norm stops the run."""
    schedule: Schedule = "cosine"
    warmup_steps: int | None = None
    """Linear warm-up from ``lr / warmup_steps`` to ``lr`` over this many steps (unset:
    ``DEFAULT_WARMUP_STEPS``, or ``warmup_ratio`` of the steps when that is set)."""
    warmup_ratio: float | None = None
    """Warm-up as a fraction of the run's steps (rounded up), as Hugging Face's
    ``warmup_ratio``; not together with ``warmup_steps``."""
    decay_fraction: float = 0.2
    """wsd only: fraction of the steps (after warm-up) spent in the final linear decay."""

    def __post_init__(self) -> None:
        _require(math.isfinite(self.lr) and self.lr > 0, "optim.lr", "a finite number > 0", self.lr)
        _require_fraction("optim.min_lr_ratio", self.min_lr_ratio)
        for index, beta in enumerate(self.betas):
            _require(0.0 <= beta < 1.0, f"optim.betas[{index}]", "in [0, 1)", beta)
        _require(
            math.isfinite(self.eps) and self.eps > 0, "optim.eps", "a finite number > 0", self.eps
        )
        _require(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            "optim.weight_decay",
            "a finite number >= 0",
            self.weight_decay,
        )
        # .inf is allowed: no clipping, the norm is still measured and checked.
        _require(self.grad_clip > 0, "optim.grad_clip", "> 0 (.inf: no clipping)", self.grad_clip)
        if self.warmup_steps is not None:
            _require(self.warmup_steps >= 0, "optim.warmup_steps", ">= 0", self.warmup_steps)
        if self.warmup_ratio is not None:
            _require_fraction("optim.warmup_ratio", self.warmup_ratio)
            if self.warmup_steps is not None:
                raise ValueError(
                    f"give optim.warmup_steps ({self.warmup_steps}) or optim.warmup_ratio "
                    f"({self.warmup_ratio}), not both"
                )
        _require_fraction("optim.decay_fraction", self.decay_fraction)

    def warmup_for(self, max_steps: int) -> int:
        """Warm-up steps of a schedule over ``max_steps`` steps."""
        if self.warmup_ratio is not None:
            return math.ceil(self.warmup_ratio * max_steps)
        return DEFAULT_WARMUP_STEPS if self.warmup_steps is None else self.warmup_steps


class TrainConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The training recipe and the loop's cadences."""

    seq_len: int | None = None
    """Tokens per row; unset: the seq_len the corpus was prepared at, which it must match."""
    micro_batch_size: int = 8
    grad_accum_steps: int = 4
    max_steps: int = 0
    """Optimizer steps; 0 = ``num_epochs`` epochs of the training windows."""
    num_epochs: int = 1
    """Epochs over the training windows, when ``max_steps`` is 0."""
    num_workers: int = 4
    prefetch_factor: int = 4
    persistent_workers: bool = True
    seed: int = 20260907
    compile: bool = True
    compile_mode: str = "default"
    compile_backend: str = "inductor"
    """torch.compile backend; 'aot_eager' compiles the graph without codegen (fast tests)."""
    compile_cache: bool = True
    """Keep the compiled kernels in the run directory (``compile_cache.bin``) and load them at
    every start, so a resume on another machine skips compiling them. The file is code the run
    executes, as inductor's own cache under /tmp is: off for a run directory from elsewhere."""
    grad_checkpoint: bool = False
    morph_dispatch: Literal["masked", "sparse", "grouped"] | None = None
    """Overrides the base model's morph_dispatch when set."""
    attn_impl: Literal["auto", "flash", "torch_varlen", "flex", "sdpa"] | None = None
    """Overrides the base model's attention backend when set: one base config serves machines
    with different backends, and a backend can be compared without editing the base run."""
    assistant_only_head: bool = True
    """Fused loss head (targets only); off = full logits + cross-entropy (reference path)."""
    loss_fp32_logits: bool = True
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """ddp replicates the model on every rank; fsdp shards parameters, gradients and AdamW
    states (FSDP2). Not part of the recipe: a run may resume under the other mode."""
    precision: Literal["auto", "bf16", "fp32", "bfloat16", "float32"] = "auto"
    """Compute dtype in both modes (ddp: autocast; fsdp: parameters), master weights and AdamW
    states fp32: auto is bf16 on a GPU with bf16 tensor cores (Ampere and later), else fp32;
    bf16 on an older GPU is refused. torch's bfloat16 and float32 are read as bf16 and fp32."""
    elastic: bool = False
    """Allow a resume with another world size, micro_batch_size or num_workers: the rest of
    the interrupted epoch is re-dealt over the new ranks (each target still once an epoch)."""
    ddp_static_graph: bool = False
    """DDP static_graph; cannot be combined with grad_accum_steps > 1 (DDP's no_sync)."""
    ddp_bucket_cap_mb: int = 100
    control_interval: int = 20
    """Steps between the all-rank archive agreements (also at checkpoints and the end); stop
    requests are agreed on at every step."""
    log_interval: int = 10
    ckpt_interval: int = 250
    keep_last: int = 3
    keep_every: int = 1000
    """Checkpoints whose step is a multiple of this are never rotated away (0 = none)."""
    archive_interval_hours: float = 4.0
    """Wall-clock cadence of weights-only archives (0 = never)."""
    max_hours: float = 71.0
    """Checkpoint and exit 0 after this much wall time (0 = no limit)."""
    save_final_checkpoint: bool = True
    async_checkpoint: bool = True
    """Copy a checkpoint's state to CPU memory (pinned on CUDA), train on and write it in the
    background, one write at a time (under fsdp every rank its shards, DCP's async_save)."""
    report_to: list[Literal["tensorboard", "wandb"]] = msgspec.field(default_factory=list)
    """Mirror metrics.jsonl to these sinks (extras nedolm-train[tensorboard] / [wandb])."""
    trust_unverified: bool = False
    """Resume from a checkpoint that carries no digest (no .sha256 sidecar, none inside: written
    before digests existed) instead of skipping it as unverifiable (``--trust-unverified``)."""

    def __post_init__(self) -> None:
        at_least = {
            "micro_batch_size": (self.micro_batch_size, 1),
            "grad_accum_steps": (self.grad_accum_steps, 1),
            "prefetch_factor": (self.prefetch_factor, 1),
            "log_interval": (self.log_interval, 1),
            "ckpt_interval": (self.ckpt_interval, 1),
            "control_interval": (self.control_interval, 1),
            "keep_last": (self.keep_last, 1),
            "num_epochs": (self.num_epochs, 1),
            "num_workers": (self.num_workers, 0),
            "max_steps": (self.max_steps, 0),
            "keep_every": (self.keep_every, 0),
            "ddp_bucket_cap_mb": (self.ddp_bucket_cap_mb, 1),
        }
        for key, (value, least) in at_least.items():
            _require(value >= least, f"train.{key}", f">= {least}", value)
        if self.seq_len is not None:
            _require(self.seq_len >= 2, "train.seq_len", ">= 2", self.seq_len)
        for key in ("max_hours", "archive_interval_hours"):
            _require(getattr(self, key) >= 0, f"train.{key}", ">= 0 (0: off)", getattr(self, key))
        if self.ddp_static_graph and self.grad_accum_steps > 1:
            # torch DDP asserts (reducer expect_autograd_hooks_) when a static graph's first
            # step accumulates under no_sync.
            raise ValueError("ddp_static_graph cannot be combined with grad_accum_steps > 1")
        if self.max_steps and self.num_epochs != 1:
            raise ValueError(
                f"give max_steps ({self.max_steps}) or num_epochs ({self.num_epochs}), not both"
            )
        self.precision = PRECISION_ALIASES.get(self.precision, self.precision)
        if self.compile:
            _refuse_cuda_graphs(self.compile_mode, self.compile_backend)
            _require_torch_choice(
                "train.compile_mode", self.compile_mode, "default", _compile_modes
            )
            _require_torch_choice(
                "train.compile_backend", self.compile_backend, "inductor", _compile_backends
            )


class ValidationConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Held-out validation on whole shards."""

    enabled: bool = True
    shard_ids: list[int] | None = None
    """Shard ids validated and held out of training (the integer after the first '-' of the
    file name). Unset: the shards the corpus itself holds out (``prepare --val-fraction``)."""
    train_on_held_out: bool = False
    """Train on the shards the corpus holds out (its manifest's ``validation_shard_ids``) when
    they are not validated here. Off: those shards never train, whatever ``shard_ids`` says."""
    interval: int = 250
    batches: int = 8
    """Micro-batches per rank per validation pass."""
    micro_batch_size: int | None = None
    """Defaults to train.micro_batch_size."""
    num_workers: int | None = None
    """Defaults to min(2, train.num_workers)."""
    seed: int = 20260920
    at_start: bool = True

    def __post_init__(self) -> None:
        _require(self.interval >= 1, "validation.interval", ">= 1", self.interval)
        _require(self.batches >= 1, "validation.batches", ">= 1", self.batches)
        if self.micro_batch_size is not None:
            _require(
                self.micro_batch_size >= 1,
                "validation.micro_batch_size",
                ">= 1",
                self.micro_batch_size,
            )
        if self.num_workers is not None:
            _require(self.num_workers >= 0, "validation.num_workers", ">= 0", self.num_workers)


class ProfileConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A torch.profiler window of optimizer steps: every rank writes a trace, its top ops and a
    summary (wall vs device-busy time per step) under ``run_dir/profile/steps-A-B/``."""

    start_step: int = 0
    """First optimizer step profiled (1-based, as the log counts them); 0 = off."""
    steps: int = 3
    """Steps in the window (it ends at the run's last step at the latest)."""

    def __post_init__(self) -> None:
        _require(self.start_step >= 0, "profile.start_step", ">= 0 (0: off)", self.start_step)
        _require(self.steps >= 1, "profile.steps", ">= 1", self.steps)


class SFTConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One SFT run: where everything lives and the recipe."""

    run_dir: Path
    """Checkpoints, metrics and logs; an existing run dir is resumed from."""
    data_dir: Path
    """A prepared, verified corpus (nedolm-sft prepare)."""
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    base_config: Path | None = None
    """The pretraining run's config YAML (holds the model config)."""
    base_run_dir: Path | None = None
    """The latest checkpoint here is the base, unless base_checkpoint is set."""
    base_checkpoint: Path | None = None
    base_hf_dir: Path | None = None
    """Instead of a base run: a Hugging Face Llama/Mistral directory (nedolm-sft import-hf)."""
    base_morph_expert_dim: int = 0
    """With base_hf_dir: add morph experts of this width (zero output at step 0); 0 = dense."""
    validation: ValidationConfig = msgspec.field(default_factory=ValidationConfig)
    profile: ProfileConfig = msgspec.field(default_factory=ProfileConfig)

    def __post_init__(self) -> None:
        run_base = (self.base_config, self.base_run_dir, self.base_checkpoint)
        if self.base_hf_dir is not None and any(p is not None for p in run_base):
            raise ValueError(
                "base_hf_dir cannot be combined with base_config/base_run_dir/base_checkpoint: "
                "start from either a Hugging Face directory or a base run"
            )
        if self.base_hf_dir is None and (self.base_config is None or self.base_run_dir is None):
            raise ValueError("give base_config and base_run_dir, or base_hf_dir")
        if self.base_morph_expert_dim < 0 or (self.base_morph_expert_dim and not self.base_hf_dir):
            raise ValueError("base_morph_expert_dim must be >= 0 and needs base_hf_dir")


class RunConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The pretraining run's config, as far as SFT needs it."""

    model: dict[str, Any]
    """Keyword arguments of nedolm.model.ModelConfig."""
    eos_id: int
    """End-of-sequence id of the tokenizer the model was pretrained with."""
    tokenizer: str | None = None
    """Where the tokenizer lives (informational)."""


def _path_hook(type_: type, value: object) -> object:
    if type_ is Path and isinstance(value, str):
        return Path(value)
    raise TypeError(f"expected {type_.__name__}, got {type(value).__name__}")


def _decode(path: Path, struct_type: type[_S], overrides: Sequence[str] = ()) -> _S:
    try:
        raw = yaml.safe_load(path.read_bytes())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of keys, got {type(raw).__name__}")
    try:
        raw = apply_overrides(raw, overrides, struct_type)
    except OverrideError as exc:
        raise ConfigError(str(exc)) from exc
    # strict=False: PyYAML reads YAML 1.1, where `1e-4` is a string, not a float.
    try:
        return msgspec.convert(raw, type=struct_type, strict=False, dec_hook=_path_hook)
    except msgspec.ValidationError as exc:
        source = f"{path} with --set {' '.join(overrides)}" if overrides else str(path)
        raise ConfigError(f"{source}: {explain(exc, struct_type)}") from exc


def _resolve(base: Path, path: Path) -> Path:
    return path if path.is_absolute() else (base / path).resolve()


def load_sft_config(path: str | Path, overrides: Sequence[str] = ()) -> SFTConfig:
    """Read an SFT YAML; relative paths inside it resolve against its directory.

    ``overrides`` are ``key.path=value`` items (``nedolm-sft run --set``), applied to the YAML
    before it is checked, so they obey the same schema.
    """
    path = Path(path)
    cfg = _decode(path, SFTConfig, overrides)
    base = path.resolve().parent
    return msgspec.structs.replace(
        cfg,
        run_dir=_resolve(base, cfg.run_dir),
        data_dir=_resolve(base, cfg.data_dir),
        **{
            key: _resolve(base, getattr(cfg, key))
            for key in ("base_config", "base_run_dir", "base_checkpoint", "base_hf_dir")
            if getattr(cfg, key) is not None
        },
    )


def check_run_paths(cfg: SFTConfig) -> None:
    """Refuse, before a run dir is created, a corpus that is not there (or not prepared: raw
    chat files) or a run dir inside it.

    A missing or unprepared ``data_dir`` would otherwise surface later as a missing contract
    file, after the run dir was made; a run dir inside the corpus would write checkpoints among
    its shards.
    """
    if not cfg.data_dir.is_dir():
        what = "is not a directory" if cfg.data_dir.exists() else "does not exist"
        raise ConfigError(
            f"data_dir {cfg.data_dir} {what}: prepare a corpus there first (nedolm-sft prepare)"
        )
    missing = [name for name in CONTRACT_FILES if not (cfg.data_dir / name).is_file()]
    if missing:
        chats = sorted(p.name for p in cfg.data_dir.iterdir() if p.suffix in CHAT_SUFFIXES)
        held = f"holds chat files ({', '.join(chats[:3])}), " if chats else ""
        raise ConfigError(
            f"data_dir {cfg.data_dir} {held}not a prepared corpus (no {', '.join(missing)}): "
            "run `nedolm-sft prepare` first (nedolm-sft prepare FILES --tokenizer ... --out "
            "CORPUS) and set data_dir to CORPUS"
        )
    if cfg.run_dir.resolve().is_relative_to(cfg.data_dir.resolve()):
        raise ConfigError(
            f"run_dir {cfg.run_dir} is inside the corpus data_dir {cfg.data_dir}: put runs "
            "beside the corpus, not in it"
        )


def load_run_config(path: str | Path) -> RunConfig:
    """Read a pretraining run config YAML."""
    return _decode(Path(path), RunConfig)


def to_builtins(cfg: msgspec.Struct) -> dict[str, object]:
    """A JSON-ready dict of a config (paths as strings), for metadata and fingerprints."""
    return msgspec.to_builtins(cfg, enc_hook=str)


def dump_config(cfg: msgspec.Struct) -> str:
    """A config as YAML, in schema order with every default: what ``--print-config`` shows."""
    return yaml.safe_dump(to_builtins(cfg), sort_keys=False, allow_unicode=True)
