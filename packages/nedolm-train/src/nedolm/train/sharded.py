"""Sharded checkpoints (torch.distributed.checkpoint) and full <-> sharded state conversion.

A sharded checkpoint is a directory in which every rank wrote its own shard of the model and
optimizer, plus DCP's ``.metadata``; ``nedolm-sharded.json`` is written last, after every shard
is on disk, and the directory only then gets its final name::

    step-00000005/              final name: renamed from .step-00000005.tmp-dcp by rank 0
      __0_0.distcp __1_0.distcp one file per rank (DCP)
      .metadata                 DCP's index of the shards
      train_state.pt            rank 0's ``payload``: progress, per-rank RNG/loader cursors
      nedolm-sharded.json       format version, world size, caller's metadata, the sha256
                                of every other file and of itself (``seal``): written last

The shards may be written in the background (``start_sharded_save`` with a
``ShardedBackground``: DCP's ``async_save`` on a gloo group of its own, staging into CPU copies
that ``kept_stager`` keeps for the run where torch allows), rank 0 then sealing on a thread. So
a save killed at any point leaves either the previous checkpoint or a hidden ``.tmp-``
directory that ``load_sharded`` refuses, and ``verify_sharded`` catches flipped bytes in any
file, the manifest included (format 1 directories, written before the digests, are read
unverified). DCP stores global shapes, so a checkpoint written by N ranks (DDP or FSDP) loads on
M ranks under either mode.

The *full* state (``full_state``/``load_full_state``) is the unsharded, name-keyed form of
``torch.distributed.checkpoint.state_dict``: the format a DDP run keeps and an export needs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from nedolm.data.atomic import atomic_write, atomic_write_bytes, fsync_dir
from nedolm.dist import all_rank_call, barrier, get_info, get_world_size, main_rank_call
from nedolm.train.async_save import BackgroundWrite
from nedolm.train.checksum import digest_mismatch, file_digests
from nedolm.train.faults import maybe_inject
from nedolm.train.parallel import unwrap

log = logging.getLogger(__name__)

MANIFEST = "nedolm-sharded.json"
PAYLOAD = "train_state.pt"
FORMAT_VERSION = 2  # 2 added the digests; 1 is still read
_READABLE_FORMATS = (1, FORMAT_VERSION)
_TMP_SUFFIX = ".tmp-dcp"  # nedolm.data.atomic.is_temporary recognises the hidden name
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class ShardedCheckpointError(RuntimeError):
    """A directory is not a complete sharded checkpoint."""


def temporary_dir(final: Path) -> Path:
    """Where ``save_sharded`` writes before the rename (hidden; the same name on every rank)."""
    return final.with_name(f".{final.name}{_TMP_SUFFIX}")


def save_sharded(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    payload: dict[str, Any] | None = None,
) -> Path:
    """Every rank writes its shard of model + optimizer; the directory appears complete or not.

    A collective: call on every rank. ``meta`` (JSON-serialisable: step, parallelism, ...)
    goes into the manifest, which rank 0 writes after all shards are on disk. Rank 0's
    ``payload`` (tensors and plain values; the other ranks' is ignored) is written as
    ``PAYLOAD`` before the manifest.

    Raises:
        nedolm.dist.RankError: on every rank, when preparing or finishing the directory failed.
        torch.distributed.checkpoint.api.CheckpointException: on every rank, when a shard
            write failed on any rank (DCP gathers the failures).
    """
    return start_sharded_save(directory, model, optimizer, meta, payload).finish()


def start_sharded_save(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    payload: dict[str, Any] | None = None,
    *,
    background: ShardedBackground | None = None,
) -> ShardedSave:
    """``save_sharded`` up to the shards: a collective that returns once they are written, or,
    with ``background``, once every rank has copied its shards to CPU memory (DCP's
    ``async_save``; its threads coordinate over the background's group, never the training's).
    The directory is sealed by ``ShardedSave.finish``, on every rank. A background save must
    be finished before the next starts: it is written from the stager's buffers.
    """
    final, tmp = Path(directory), temporary_dir(Path(directory))
    manifest = {"format": FORMAT_VERSION, "world_size": get_world_size(), "meta": meta}
    json.dumps(manifest)  # before any rank touches disk: bad meta fails here, on all ranks

    def prepare() -> None:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir(parents=True)

    main_rank_call(get_info(), f"prepare {tmp}", prepare)  # nobody writes before it is clean
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    if background is None:
        dcp.save(state, checkpoint_id=tmp)
        return ShardedSave(final, manifest, payload, written=None)
    written = dcp.async_save(
        state,
        checkpoint_id=tmp,
        process_group=background.group,
        async_stager=background.stager,
    )
    return ShardedSave(final, manifest, payload, written=written)


@dataclass(frozen=True)
class ShardedBackground:
    """What a run keeps for its sharded saves in the background: a gloo group for DCP's
    threads (collectives of two threads must not share one process group) and, where torch
    allows, the stager whose CPU copies of this rank's shards every save reuses (None: DCP's
    default, a new stager and new copies per save)."""

    group: dist.ProcessGroup
    stager: DefaultStager | None


def sharded_background(device: torch.device) -> ShardedBackground:
    """A collective: every rank creates it, once."""
    return ShardedBackground(dist.new_group(backend="gloo"), kept_stager(device))


def kept_stager(device: torch.device) -> DefaultStager | None:
    """A stager that keeps its CPU copies (one per source storage) for the next save, pinned
    at their exact size on CUDA, where the copies run non-blocking and are synchronized before
    the write starts; None where this torch's cannot stage twice.

    DCP's ``async_save`` without a stager copies each save into new pageable memory, allocated
    and faulted in while training waits, then dropped. torch 2.11's ``DefaultStager`` empties
    its copier after each stage (its second stage raises ``KeyError``; 2.10's and 2.13's keep
    it): two stages of a one-element state tell which this torch is. Any failure there means
    DCP's default, said in the log: a run must not end for a faster checkpoint.
    """
    cuda = device.type == "cuda"
    probe = {"probe": torch.zeros(1, device=device)}
    try:
        options = StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=cuda,
        )
        stager = DefaultStager(options)
        stager.stage(probe)
        stager.stage(probe)
    except Exception as error:  # torch 2.11: KeyError at the second stage
        log.info(
            "DCP's stager cannot stage twice here (%s: %s): each background sharded save "
            "stages into new memory",
            type(error).__name__,
            error,
        )
        return None
    return stager


class ShardedSave:
    """A sharded save whose shards are written, or being written in the background.

    In the background, rank 0 seals the directory as soon as its own write has returned: DCP
    writes ``.metadata`` on rank 0 only after every rank reported its shards written, so the
    checkpoint is complete and visible without waiting for the training thread.
    """

    def __init__(
        self,
        final: Path,
        manifest: dict[str, Any],
        payload: dict[str, Any] | None,
        *,
        written: Future | None,
    ) -> None:
        self.final = final
        self.manifest = manifest
        self.payload = payload
        self.written = written
        self.write_s: float | None = None
        """Seconds rank 0's background write and seal took (None: written in the step)."""
        self._sealing: BackgroundWrite | None = None
        if written is not None and get_info().is_main:
            self._sealing = BackgroundWrite()
            self._sealing.submit(f"seal {final.name}", self._seal_when_written)

    def done(self) -> bool:
        """This rank's part has ended (rank 0: shards written and sealed, or failed)."""
        if self._sealing is not None:
            return self._sealing.finished()
        return self.written is None or self.written.done()

    def finish(self) -> Path:
        """A collective: wait until every rank's shards are written and rank 0 has added the
        payload, sealed the manifest and renamed the directory to its final name.

        Raises:
            nedolm.dist.RankError: on every rank, when any rank's shards or the seal failed.
        """
        info = get_info()
        if self.written is not None:
            all_rank_call(info, f"write {self.final}", self._wait)
            return self.final
        barrier()  # every rank's shard is on disk
        maybe_inject("sharded_finish", info.rank)
        main_rank_call(info, f"finish {self.final}", self._seal)
        return self.final

    def _wait(self) -> None:
        if self._sealing is not None:
            self.write_s = self._sealing.collect()  # raises the seal's (or the shards') failure
            return
        assert self.written is not None
        self.written.result()

    def _seal_when_written(self) -> None:
        assert self.written is not None
        self.written.result()  # raises the shards' failure, gathered from every rank
        maybe_inject("sharded_finish", 0)
        self._seal()

    def _seal(self) -> None:
        tmp, final, manifest = temporary_dir(self.final), self.final, self.manifest
        if self.payload is not None:
            atomic_write(tmp / PAYLOAD, lambda handle: torch.save(self.payload, handle))
        manifest["sha256"] = file_digests(tmp)  # every shard, .metadata and the payload
        manifest["seal"] = _seal(manifest)
        atomic_write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=2).encode())
        if final.exists():  # a re-save of the same step after a resume
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_dir(final.parent)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a complete sharded checkpoint.

    Raises:
        ShardedCheckpointError: no manifest (a save that did not finish) or an unknown format.
    """
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ShardedCheckpointError(
            f"{directory}: not a complete sharded checkpoint (no {MANIFEST})"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardedCheckpointError(f"{path} is corrupt: {exc}") from exc
    if manifest.get("format") not in _READABLE_FORMATS:
        raise ShardedCheckpointError(
            f"{path}: format {manifest.get('format')!r}, this version reads {_READABLE_FORMATS}"
        )
    return manifest


def has_digests(directory: Path) -> bool:
    """True when a complete sharded checkpoint's manifest lists its files' digests (format 2+)."""
    return "seal" in read_manifest(directory)


def verify_sharded(directory: Path) -> None:
    """Check every file of a complete sharded checkpoint against its manifest's digests.

    Raises:
        ShardedCheckpointError: incomplete, or a file is missing or its bytes changed.
    """
    manifest = read_manifest(directory)
    if manifest["format"] == 1 and "seal" not in manifest:
        return  # written before the digests existed
    if manifest.get("seal") != _seal(manifest):
        mismatch = f"{MANIFEST} does not match its own seal"
    else:
        mismatch = digest_mismatch(directory, manifest["sha256"])
    if mismatch is not None:
        raise ShardedCheckpointError(f"{directory} is corrupt: {mismatch}")


def _seal(manifest: dict[str, Any]) -> str:
    """The sha256 of the manifest's canonical JSON without its seal: flips in it show too."""
    body = {key: value for key, value in manifest.items() if key != "seal"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_payload(directory: Path) -> dict[str, Any]:
    """The ``payload`` saved with a complete sharded checkpoint (read on CPU, tensors only).

    Raises:
        ShardedCheckpointError: incomplete checkpoint, or one saved without a payload.
    """
    read_manifest(directory)
    path = Path(directory) / PAYLOAD
    if not path.is_file():
        raise ShardedCheckpointError(f"{directory}: sharded checkpoint has no {PAYLOAD}")
    return torch.load(path, map_location="cpu", weights_only=True)


_SINGLE_PROCESS_LOAD = "torch.distributed is disabled, unavailable or uninitialized"
"""The start of torch's warning on a load in one process (``filterwarnings`` matches starts)."""


def load_sharded_model(directory: Path, model: nn.Module) -> None:
    """Load only the model weights of a sharded checkpoint into a plain model (one process).

    For export and generation: the optimizer shards are not read. torch warns on every load
    without a process group (even with ``no_dist``) that it assumes one process, which is the
    intent here, so that one message is filtered out of what ``export`` and ``chat`` print.
    """
    read_manifest(directory)
    state = {"model": get_model_state_dict(model)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_LOAD, category=UserWarning)
        dcp.load(state, checkpoint_id=Path(directory), no_dist=True)
    set_model_state_dict(model, state["model"])


def load_sharded(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Load a sharded checkpoint into ``model``/``optimizer`` (any world size, either mode).

    A collective: call on every rank, after ``parallelize`` and ``build_optimizer``.

    Returns:
        The ``meta`` given to ``save_sharded``.

    Raises:
        nedolm.dist.RankError: on every rank, when the directory is incomplete on any rank.
    """
    info = get_info()
    manifest = all_rank_call(info, f"read {directory}", lambda: read_manifest(directory))
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=Path(directory))  # fills the local shards in place
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return manifest["meta"]


def full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Unsharded model and optimizer state, on CPU, on rank 0 (empty dicts on the others).

    A collective under FSDP: shards are all-gathered one tensor at a time and moved to the
    CPU, so no GPU ever holds the whole state. Both dicts are keyed by parameter name (the
    bare model's names, no ``module.`` prefix), so they load into either mode with
    ``load_full_state``; the model dict is also what an export writes.
    """
    model_state, optim_state = get_state_dict(model, optimizer, options=_FULL)
    return model_state, optim_state


def full_model_state(model: nn.Module) -> dict[str, Any]:
    """``full_state``'s model dict alone (rank 0; empty elsewhere), for an export."""
    return get_model_state_dict(model, options=_FULL)


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    optim_state: dict[str, Any],
) -> None:
    """Load a full state (``full_state`` of a DDP or FSDP run) into ``model``/``optimizer``.

    A collective. Only rank 0's dicts are read (the others may pass empty ones): rank 0
    broadcasts each tensor and every rank keeps its shard under FSDP, its copy under DDP.

    Raises:
        nedolm.dist.RankError: on every rank, naming the first missing or unexpected
            parameter when rank 0's model dict does not fit the model.
    """
    names = set(unwrap(model).state_dict())  # local: FSDP2 returns its shards unsent
    main_rank_call(get_info(), "check full state", lambda: _check_names(model_state, names))
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    # Two calls, not set_state_dict: that one skips the model on a rank whose model dict is
    # empty (torch 2.13), so ranks > 0 would miss rank 0's broadcasts and hang.
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optim_state, options=options)


def _check_names(model_state: dict[str, Any], names: set[str]) -> None:
    missing, unexpected = sorted(names - set(model_state)), sorted(set(model_state) - names)
    if missing or unexpected:
        raise ShardedCheckpointError(
            f"full state does not fit the model: {len(missing)} missing (first: "
            f"{missing[:1]}), {len(unexpected)} unexpected (first: {unexpected[:1]})"
        )
