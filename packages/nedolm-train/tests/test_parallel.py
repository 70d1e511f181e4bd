"""FSDP2 against DDP on two real gloo ranks, sharded checkpoints across a SIGKILL, full state
moved between the two modes (parallel_worker.py is one rank of those runs), and per-source
validation passes on both (validation_worker.py)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager
from torch.nn.parallel import DistributedDataParallel

from nedolm.dist import DistInfo, RankError
from nedolm.model import build_model
from nedolm.train.checkpoint import checkpoint_path, latest_checkpoint
from nedolm.train.optim import build_optimizer
from nedolm.train.parallel import (
    mixed_precision_policy,
    no_buffer_sync_per_forward,
    parallelize,
)
from nedolm.train.sharded import (
    MANIFEST,
    PAYLOAD,
    kept_stager,
    load_full_state,
    load_sharded,
    save_sharded,
    sharded_background,
    start_sharded_save,
    temporary_dir,
)


def load_worker(name: str) -> tuple[Path, ModuleType]:
    """A worker script beside this file, and the module it is (what its ranks build)."""
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


WORKER, WORKER_MODULE = load_worker("parallel_worker")  # the model config the workers train
VALIDATION_WORKER, VALIDATION_MODULE = load_worker("validation_worker")
TIMEOUT_S = 300
SAVE_AT = 5


class Ranks:
    """Two worker processes of one process group; a hang fails the test, never blocks it."""

    def __init__(
        self, out_dir: Path, *args: str, world_size: int = 2, worker: Path = WORKER
    ) -> None:
        self.out_dir = out_dir
        out_dir.mkdir(parents=True)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.procs = []
        for rank in range(world_size):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "NEDOLM_DIST_TIMEOUT_S": "120",
                "CUDA_VISIBLE_DEVICES": "",
            }
            with (out_dir / f"rank{rank}.log").open("wb") as log:
                cmd = [sys.executable, str(worker), str(out_dir), *args]
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            self.procs.append(proc)

    def logs(self) -> str:
        return "\n".join(
            (self.out_dir / f"rank{r}.log").read_text(encoding="utf-8")[-3000:]
            for r in range(len(self.procs))
        )

    def kill(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)

    def wait(self) -> list[int]:
        """Every worker's exit code."""
        deadline = time.monotonic() + TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"worker hung:\n{self.logs()}")
        return [p.returncode for p in self.procs]

    def wait_ok(self) -> Path:
        assert self.wait() == [0] * len(self.procs), self.logs()
        return self.out_dir

    def wait_for(self, names: list[str]) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not all((self.out_dir / n).exists() for n in names):
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"workers never reached {names}:\n{self.logs()}")
            time.sleep(0.05)


def losses(run: Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads((run / "losses.json").read_text("utf-8")).items()}


CROSS_MODE_RTOL = 1e-5
"""FSDP and DDP sum the float64 gradient norm from different partial sums (row shards, whole
tensors); its last bits can round the float32 clip factor one ulp apart, and AdamW carries that
into losses and weights: under 1e-6 on the dev machine, 1.3e-6 on a CI machine after 10 steps.
A missed or misplaced shard changes whole rows, far above this bound."""


def assert_relative_close(ours: torch.Tensor, theirs: torch.Tensor, name: str) -> None:
    """Relative error of the whole tensor (elementwise is ill-posed near zero)."""
    error = (ours.double() - theirs.double()).norm() / theirs.double().norm().clamp_min(1e-30)
    assert error <= CROSS_MODE_RTOL, f"{name}: relative error {error:.3g}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Uninterrupted 10-step runs on 2 ranks under both modes (started together)."""
    root = tmp_path_factory.mktemp("parallel")
    groups = {m: Ranks(root / m, m, "--save-at", str(SAVE_AT)) for m in ("fsdp", "ddp")}
    return {mode: group.wait_ok() for mode, group in groups.items()}


@pytest.mark.slow
def test_fsdp_matches_ddp_losses_and_weights(runs: dict[str, Path]) -> None:
    fsdp, ddp = losses(runs["fsdp"]), losses(runs["ddp"])
    assert sorted(fsdp) == list(range(10)) == sorted(ddp)
    for step in ddp:
        assert fsdp[step] == pytest.approx(ddp[step], rel=CROSS_MODE_RTOL, abs=0), step
    # The gathered FSDP state is the bare model's state_dict, names and shapes included.
    fsdp_final = torch.load(runs["fsdp"] / "final.pt", weights_only=True)
    ddp_final = torch.load(runs["ddp"] / "final.pt", weights_only=True)
    bare = build_model(WORKER_MODULE.MODEL)
    bare.load_state_dict(fsdp_final, strict=True)  # every name and shape of the bare model
    assert fsdp_final.keys() == ddp_final.keys()
    for name, tensor in ddp_final.items():
        assert_relative_close(fsdp_final[name], tensor, name)
    # The optimizer moments gathered at the save step agree as well.
    fsdp_full = torch.load(runs["fsdp"] / f"full-{SAVE_AT}.pt", weights_only=True)
    ddp_full = torch.load(runs["ddp"] / f"full-{SAVE_AT}.pt", weights_only=True)
    assert fsdp_full["optim"]["state"].keys() == ddp_full["optim"]["state"].keys()
    for name, moments in ddp_full["optim"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert_relative_close(fsdp_full["optim"]["state"][name][key], moments[key], name)


@pytest.mark.slow
def test_killed_fsdp_run_resumes_from_sharded_checkpoint_exactly(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    killed = Ranks(tmp_path / "killed", "fsdp", "--save-at", str(SAVE_AT), "--hold-at", "7")
    killed.wait_for(["holding0", "holding1"])  # two steps past the save
    killed.kill()
    checkpoint = tmp_path / "killed" / "sharded"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        MANIFEST,
    ]
    # A fresh group with other initial weights: everything must come from the checkpoint.
    resumed = Ranks(
        tmp_path / "resumed",
        "fsdp",
        "--init-seed",
        "1",
        "--start",
        str(SAVE_AT),
        "--load-sharded",
        str(checkpoint),
    ).wait_ok()
    expected = losses(runs["fsdp"])
    assert losses(resumed) == {s: expected[s] for s in range(SAVE_AT, 10)}  # bitwise
    ours = torch.load(resumed / "final.pt", weights_only=True)
    theirs = torch.load(runs["fsdp"] / "final.pt", weights_only=True)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.slow
def test_full_state_moves_between_ddp_and_fsdp(runs: dict[str, Path], tmp_path: Path) -> None:
    """DDP's full state resumed under FSDP continues as DDP did, and the other way round."""
    steps = ("--init-seed", "1", "--start", str(SAVE_AT), "--stop", str(SAVE_AT + 2))
    groups = {
        source: Ranks(
            tmp_path / f"{source}-into-{target}",
            target,
            *steps,
            "--load-full",
            str(runs[source] / f"full-{SAVE_AT}.pt"),
        )
        for source, target in (("ddp", "fsdp"), ("fsdp", "ddp"))
    }
    for source, group in groups.items():
        ours, expected = losses(group.wait_ok()), losses(runs[source])
        assert sorted(ours) == [SAVE_AT, SAVE_AT + 1]
        for step, loss in ours.items():  # the second step also depends on the AdamW moments
            assert loss == pytest.approx(expected[step], rel=CROSS_MODE_RTOL, abs=0), (source, step)


def tiny_model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = parallelize(
        build_model(WORKER_MODULE.MODEL), "fsdp", device=torch.device("cpu"), compute="fp32"
    )
    return model, build_optimizer(model, WORKER_MODULE.OPTIM)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_save_replaces_a_killed_save_and_refuses_a_partial_one(tmp_path: Path) -> None:
    model, optimizer = tiny_model_and_optimizer(seed=0)
    final = tmp_path / "step-00000005"
    killed = temporary_dir(final)  # what a save killed before its rename leaves behind
    killed.mkdir()
    (killed / "__0_0.distcp").write_bytes(b"half a shard")
    assert save_sharded(final, model, optimizer, {"step": 5}) == final
    assert not killed.exists() and (final / MANIFEST).is_file()

    other, other_optimizer = tiny_model_and_optimizer(seed=1)
    assert load_sharded(final, other, other_optimizer) == {"step": 5}
    loaded = other.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor), name

    (final / MANIFEST).unlink()  # shards and DCP metadata on disk, manifest not yet written
    with pytest.raises(RankError, match="not a complete sharded checkpoint"):
        load_sharded(final, other, other_optimizer)


def _full_weights_and_moments(model, optimizer) -> list[torch.Tensor]:
    """Every parameter and its AdamW first moment, unsharded, in parameter order."""
    params = list(model.parameters())
    moments = [optimizer.state[p]["exp_avg"] for p in params]
    return [t.full_tensor().clone() for t in params + moments]


def test_a_stager_that_cannot_stage_twice_leaves_the_saves_to_dcps_default(
    monkeypatch, caplog
) -> None:
    """torch 2.11's stager fails at its second stage (KeyError); whatever a torch's does, the
    start-up check falls back to DCP's default and says why, rather than failing the run."""
    staged = []

    def stage_once(self, state_dict, **kwargs):
        if staged:
            raise KeyError(type)
        staged.append(state_dict)
        return state_dict

    monkeypatch.setattr(DefaultStager, "stage", stage_once)
    with caplog.at_level("INFO", logger="nedolm.train.sharded"):
        assert kept_stager(torch.device("cpu")) is None
    assert "cannot stage twice here (KeyError" in caplog.text


class HeldWrites:
    """Holds DCP's file writes, which ``async_save`` runs on its upload thread, until released:
    a training step taken meanwhile certainly runs while its checkpoint is being written."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered, self.released = threading.Event(), threading.Event()
        write = FileSystemWriter.write_data

        def held_write(writer, *args, **kwargs):
            self.entered.set()
            if not self.released.wait(TIMEOUT_S):
                raise TimeoutError("the test never released the held write")
            return write(writer, *args, **kwargs)

        monkeypatch.setattr(FileSystemWriter, "write_data", held_write)

    def wait_until_held(self) -> None:
        assert self.entered.wait(TIMEOUT_S), "the background save never reached its write"

    def release(self) -> None:
        self.released.set()

    def hold_next(self) -> None:
        self.entered.clear()
        self.released.clear()


def _train_step(model, optimizer, seed: int) -> None:
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(seed))
    loss, _ = model(ids[:, :-1], labels=ids[:, 1:], return_logits=False)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_background_sharded_saves_hold_their_own_step_while_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's background saves share one ``sharded_background``: its stager's CPU copies
    (where this torch can keep them; torch 2.11's stages once, and DCP's default is used)
    are overwritten by the next save, after the previous one is finished. Each save's write is
    held until a training step has changed every weight and moment in place, so a stager whose
    copies aliased the live shards would write that later step. Each checkpoint loads exactly
    the weights and AdamW moments of its own step."""
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    writes = HeldWrites(monkeypatch)
    try:
        model, optimizer = tiny_model_and_optimizer(seed=0)
        background = sharded_background(torch.device("cpu"))
        saved: dict[Path, list[torch.Tensor]] = {}
        for step in (1, 2, 3):
            _train_step(model, optimizer, seed=step)
            directory = tmp_path / f"step-{step}"
            writes.hold_next()
            save = start_sharded_save(
                directory, model, optimizer, {"step": step}, {}, background=background
            )
            saved[directory] = _full_weights_and_moments(model, optimizer)
            writes.wait_until_held()
            _train_step(model, optimizer, seed=100 + step)  # during the write
            after = _full_weights_and_moments(model, optimizer)
            assert not any(map(torch.equal, saved[directory], after))
            writes.release()
            save.finish()
        first, second, _ = saved.values()
        assert not any(torch.equal(a, b) for a, b in zip(first, second, strict=True))
        for directory, want in saved.items():
            other, other_optimizer = tiny_model_and_optimizer(seed=1)
            assert load_sharded(directory, other, other_optimizer)["step"] == int(
                directory.name.split("-")[1]
            )
            got = _full_weights_and_moments(other, other_optimizer)
            for index, (loaded, expected) in enumerate(zip(got, want, strict=True)):
                assert torch.equal(loaded, expected), (directory.name, index)
    finally:
        writes.release()  # a failed assertion must not leave the upload thread waiting
        torch.distributed.destroy_process_group()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_flipped_byte_in_any_file_of_a_sharded_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer = tiny_model_and_optimizer(seed=0)
    older, newest = (checkpoint_path(tmp_path, step).with_suffix("") for step in (4, 5))
    for step, directory in ((4, older), (5, newest)):
        save_sharded(directory, model, optimizer, {"step": step}, payload={"step": step})
    assert latest_checkpoint(tmp_path) == newest
    files = sorted(newest.iterdir())
    assert {path.name for path in files} >= {"__0_0.distcp", ".metadata", PAYLOAD, MANIFEST}
    for path in files:
        data = path.read_bytes()
        offset = len(data) // 2
        path.write_bytes(data[:offset] + bytes([data[offset] ^ 0x01]) + data[offset + 1 :])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="nedolm.train.checkpoint"):
            assert latest_checkpoint(tmp_path) == older, path.name
        [warning] = [record.getMessage() for record in caplog.records]
        assert f"{newest} is corrupt: " in warning, warning
        if path.name != MANIFEST:
            assert f"{path.name}: sha256 " in warning and "does not match the manifest" in warning
        path.write_bytes(data)  # flipped back: valid again
        assert latest_checkpoint(tmp_path) == newest


def test_full_state_that_does_not_fit_is_refused_by_name() -> None:
    model, optimizer = tiny_model_and_optimizer(seed=0)
    state = dict(model.state_dict())
    state["head.weight"] = state.pop("norm.weight")
    with pytest.raises(RankError, match=r"missing \(first: \['norm.weight'\]\), 1 unexpected"):
        load_full_state(model, optimizer, state, {})


def test_parallelism_and_precision_are_validated() -> None:
    model = build_model(WORKER_MODULE.MODEL)
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="parallelism must be one of"):
        parallelize(model, "zero3", device=cpu, compute="fp32")  # type: ignore[arg-type]
    for unresolved in ("fp16", "auto"):  # `auto` is resolved against the device before
        with pytest.raises(ValueError, match=rf"compute precision must be one of .*'{unresolved}'"):
            parallelize(model, "fsdp", device=cpu, compute=unresolved)  # type: ignore[arg-type]
    fp32 = mixed_precision_policy("fp32")
    assert (fp32.param_dtype, fp32.reduce_dtype) == (torch.float32, torch.float32)
    bf16 = mixed_precision_policy("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_per_source_validation_runs_one_forward_per_batch_on_every_rank(
    val_inputs_corpus: Path, tmp_path: Path
) -> None:
    """Ranks validate different rows (rank 0 mixes both inputs, rank 1 reads one): split by
    source, rank 0 would run more forwards than rank 1, and under FSDP each forward gathers
    every block, so its gathers would pair with the wrong ones of rank 1 (or hang). Every rank
    runs one forward per batch, and both modes give what one process finds over both ranks'
    rows: the target-weighted whole of the two passes."""
    corpus, worker = val_inputs_corpus, VALIDATION_MODULE
    groups = {
        mode: Ranks(tmp_path / mode, mode, str(corpus), worker=VALIDATION_WORKER)
        for mode in ("ddp", "fsdp")
    }
    cpu = DistInfo(0, 1, 0, torch.device("cpu"))
    model = worker.tiny_model(corpus)
    passes = [worker.validate(model, corpus, ids, cpu) for ids in worker.SHARDS_OF_RANK]
    assert [len(p.targets_by_source) for p in passes] == [2, 1]
    targets = sum(p.targets for p in passes)
    names = passes[0].targets_by_source
    by_source = {name: sum(p.targets_by_source.get(name, 0) for p in passes) for name in names}
    for mode, group in groups.items():
        out = group.wait_ok()
        forwards = [json.loads((out / f"rank{r}.json").read_text())["forwards"] for r in (0, 1)]
        assert forwards == [worker.batches(corpus)] * 2, mode
        result = json.loads((out / "result.json").read_text())
        assert result["targets"] == targets and result["targets_by_source"] == by_source, mode
        assert result["loss"] == pytest.approx(
            sum(p.loss * p.targets for p in passes) / targets, rel=1e-6
        ), mode
        for name, count in by_source.items():
            summed = sum(
                p.loss_by_source.get(name, 0) * p.targets_by_source.get(name, 0) for p in passes
            )
            assert result["loss_by_source"][name] == pytest.approx(summed / count, rel=1e-6)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_validation_failure_on_one_rank_is_reported_by_it(
    val_inputs_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Rank 1 fails as its pass starts. Under DDP (no collective inside the pass) both ranks
    exchange their status and raise rank 1's error; under FSDP rank 0 is already gathering the
    first block, which an exchange would pair with wrongly, so rank 1 raises its own error at
    once (the launcher stops the rest)."""
    monkeypatch.setenv("NEDOLM_TEST_FAULT", "validation@1")
    ranks = Ranks(tmp_path / mode, mode, str(val_inputs_corpus), worker=VALIDATION_WORKER)
    codes = ranks.wait()
    failure = "validation failed: rank 1: InjectedFault: injected fault at validation on rank 1"
    logs = [(tmp_path / mode / f"rank{r}.log").read_text(encoding="utf-8") for r in (0, 1)]
    assert codes[1] != 0 and failure in logs[1], logs[1]
    assert "collect_rank_errors" not in logs[1], logs[1]
    if mode == "ddp":
        assert codes[0] != 0 and failure in logs[0], logs[0]


class Torch211DistributedDataParallel:
    """torch 2.10/2.11's DistributedDataParallel keywords (abridged): no forward_sync_buffers."""

    def __init__(self, module, device_ids=None, broadcast_buffers=True, static_graph=False):
        pass


def test_ddp_is_told_in_its_own_torchs_keyword_not_to_sync_buffers_per_forward(
    tmp_path: Path,
) -> None:
    """torch 2.10/2.11 refused ``forward_sync_buffers`` (TypeError: every DDP run died at
    start-up); 2.13 deprecates ``broadcast_buffers``. A real one-rank gloo DDP on this torch
    takes the keyword chosen, warns nothing, and syncs no buffer before a forward."""
    legacy = no_buffer_sync_per_forward(Torch211DistributedDataParallel)
    assert legacy == {"broadcast_buffers": False}
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ddp = parallelize(
                build_model(WORKER_MODULE.MODEL), "ddp", device=torch.device("cpu"), compute="fp32"
            )
        assert isinstance(ddp, DistributedDataParallel)
        assert len(ddp.modules_buffers) > 0 and not ddp.will_sync_module_buffers()
    finally:
        torch.distributed.destroy_process_group()
