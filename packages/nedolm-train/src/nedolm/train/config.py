"""Typed configs of an SFT run, loaded strictly from YAML.

Three documents meet here: the SFT YAML (``SFTConfig``: where the run, the base model and the
data live, plus the ``optim``/``train``/``validation`` recipe), the pretraining run's config
(``RunConfig``: the model config as a plain dict, the EOS id) and ``OptimConfig``. Every struct
forbids unknown fields, so a typo is an error naming the key and the file, never a silently
ignored knob. Relative paths resolve against the directory of the YAML that holds them, so a
config works from any current directory. Every default is documented in ``examples/sft.yaml``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
import yaml

from nedolm.train.config_schema import OverrideError, apply_overrides, explain

Schedule = Literal["cosine", "linear", "wsd", "constant"]
_S = TypeVar("_S", bound=msgspec.Struct)


class ConfigError(ValueError):
    """A config file is missing, unparsable, or holds an unknown or invalid key."""


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
    warmup_steps: int = 100
    """Linear warm-up from ``lr / warmup_steps`` to ``lr`` over this many steps."""
    decay_fraction: float = 0.2
    """wsd only: fraction of the steps (after warm-up) spent in the final linear decay."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction must be in [0, 1], got {self.decay_fraction}")
        if self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be > 0, got {self.grad_clip}")


class TrainConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The training recipe and the loop's cadences."""

    seq_len: int | None = None
    """Tokens per row (the model's max_seq_len when unset); must match the corpus audit."""
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
    grad_checkpoint: bool = False
    morph_dispatch: Literal["masked", "sparse"] | None = None
    """Overrides the base model's morph_dispatch when set."""
    assistant_only_head: bool = True
    """Fused loss head (targets only); off = full logits + cross-entropy (reference path)."""
    loss_fp32_logits: bool = True
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """ddp replicates the model on every rank; fsdp shards parameters, gradients and AdamW
    states (FSDP2). Not part of the recipe: a run may resume under the other mode."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """fsdp only: parameter/reduce dtype (auto: bf16 on CUDA, fp32 on CPU)."""
    elastic: bool = False
    """Allow a resume with another world size, micro_batch_size or num_workers: the rest of
    the interrupted epoch is re-dealt over the new ranks (each target still once an epoch)."""
    ddp_static_graph: bool = False
    """DDP static_graph; cannot be combined with grad_accum_steps > 1 (DDP's no_sync)."""
    ddp_bucket_cap_mb: int = 100
    control_interval: int = 20
    """Steps between the all-rank stop/archive agreements (also at checkpoints and the end)."""
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
    report_to: list[Literal["tensorboard", "wandb"]] = msgspec.field(default_factory=list)
    """Mirror metrics.jsonl to these sinks (extras nedolm-train[tensorboard] / [wandb])."""
    trust_unverified: bool = False
    """Resume from a checkpoint that carries no digest (no .sha256 sidecar, none inside: written
    before digests existed) instead of skipping it as unverifiable (``--trust-unverified``)."""

    def __post_init__(self) -> None:
        positive = {
            "micro_batch_size": self.micro_batch_size,
            "grad_accum_steps": self.grad_accum_steps,
            "log_interval": self.log_interval,
            "ckpt_interval": self.ckpt_interval,
            "control_interval": self.control_interval,
            "keep_last": self.keep_last,
        }
        for key, value in positive.items():
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if self.ddp_static_graph and self.grad_accum_steps > 1:
            # torch DDP asserts (reducer expect_autograd_hooks_) when a static graph's first
            # step accumulates under no_sync.
            raise ValueError("ddp_static_graph cannot be combined with grad_accum_steps > 1")
        if self.seq_len is not None and self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
        if self.num_workers < 0 or self.max_steps < 0 or self.keep_every < 0:
            raise ValueError("num_workers, max_steps and keep_every must be >= 0")
        if self.num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1, got {self.num_epochs}")
        if self.max_steps and self.num_epochs != 1:
            raise ValueError(
                f"give max_steps ({self.max_steps}) or num_epochs ({self.num_epochs}), not both"
            )
        if self.max_hours < 0 or self.archive_interval_hours < 0:
            raise ValueError("max_hours and archive_interval_hours must be >= 0")


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
        if self.interval < 1 or self.batches < 1:
            raise ValueError("validation interval and batches must be >= 1")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError("validation micro_batch_size must be >= 1")
        if self.num_workers is not None and self.num_workers < 0:
            raise ValueError("validation num_workers must be >= 0")


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
    """Refuse, before a run dir is created, a corpus that is not there or a run dir inside it.

    A missing ``data_dir`` would otherwise surface later as a missing contract file, after the
    run dir was made; a run dir inside the corpus would write checkpoints among its shards.
    """
    if not cfg.data_dir.is_dir():
        what = "is not a directory" if cfg.data_dir.exists() else "does not exist"
        raise ConfigError(
            f"data_dir {cfg.data_dir} {what}: prepare a corpus there first (nedolm-sft prepare)"
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
