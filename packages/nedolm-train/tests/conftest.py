"""Shared fixtures: one real prepared corpus and one tiny base run per test session, plus
helpers that run the trainer in real subprocesses (``python -m nedolm.train``).

The corpus is built by the real builder from the data package's committed fixture (real Turkish
chat records, the mistral_v1 tokenizer) at seq_len 256: 4 shards, shard 2 held out, 38
training windows, so with micro-batch 1 x grad-accum 2 an epoch is exactly 19 steps.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from nedolm.data.builder import BuildOptions, build_corpus
from nedolm.train.checkpoint import latest_checkpoint, load_checkpoint
from nedolm.train.metrics import read_metrics
from nedolm.train.signals import STOP_SIGNALS
from nedolm.train.testing import all_frozen, init_tiny_base, sft_paths

FIXTURES = Path(__file__).resolve().parents[2] / "nedolm-data" / "tests" / "fixtures"
SEQ_LEN = 256
VAL_SHARD = 2
EPOCH_STEPS = 19  # 38 training windows / (micro_batch 1 * grad_accum 2)
MAX_STEPS = EPOCH_STEPS + 3  # the reference run crosses one epoch boundary
TINY = {
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_dim": 128,
    "n_morph_classes": 3,
    "morph_expert_dim": 32,
    "max_seq_len": SEQ_LEN,
}
# Cadence keys are free; every other key is part of the reference recipe.
BASE_SETTINGS: dict[str, dict[str, Any]] = {
    "optim": {"lr": 3e-3, "warmup_steps": 3, "schedule": "cosine"},
    "train": {
        "seq_len": SEQ_LEN,
        "micro_batch_size": 1,
        "grad_accum_steps": 2,
        "max_steps": MAX_STEPS,
        "num_workers": 0,
        "prefetch_factor": 2,
        "compile": False,
        "compile_backend": "aot_eager",
        "log_interval": 1,
        "control_interval": 1,
        "ckpt_interval": 1000,
        "keep_last": 3,
        "keep_every": 0,
        "archive_interval_hours": 0.0,
    },
    "validation": {"shard_ids": [VAL_SHARD], "interval": 10, "batches": 2},
}
PROCESS_TIMEOUT_S = 180
REPO = Path(__file__).resolve().parents[3]
LEGACY_COMMIT = "99e6e39e5b0d371be0dc784b46f94ae1dae776fa"
"""The last commit whose trainer wrote checkpoint format version 1 (no ``format_version``)."""
MODEL_KEYS_SINCE_LEGACY = {"tie_embeddings": True, "rope_scaling": None}
"""ModelConfig fields added after ``LEGACY_COMMIT``, with the defaults that keep its model."""
UNCLIPPED = {"grad_clip": 1e9}
"""For the old and this trainer to train bitwise alike: they clip by a float32 and a float64
gradient norm, so the factors of a binding clip differ in the last bits."""


@pytest.fixture(autouse=True)
def _restore_signal_handlers() -> Iterator[None]:
    """In-process runs install SIGTERM/SIGUSR1/SIGINT handlers; give pytest its own back."""
    saved = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    tokenizer = root / "tokenizer.json"
    with gzip.open(FIXTURES / "tokenizer" / "mistral_v1.tokenizer.json.gz", "rb") as src:
        tokenizer.write_bytes(src.read())
    inputs = sorted(p for p in (FIXTURES / "tr_chat").glob("*.jsonl") if "alpaca" not in p.name)
    options = BuildOptions(seq_len=SEQ_LEN, shards=4, val_shards=(VAL_SHARD,))
    build_corpus(inputs, tokenizer, root / "data", options)
    return root / "data"


@pytest.fixture(scope="session")
def val_inputs_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A corpus built with two validation inputs: shards 2 and 3 hold one each."""
    chat = FIXTURES / "tr_chat"
    out = tmp_path_factory.mktemp("val-inputs") / "data"
    build_corpus(
        [chat / "nutuk_qa.jsonl", chat / "truthfulqa_tr.jsonl"],
        FIXTURES / "tokenizer" / "mistral_v1.tokenizer.json.gz",
        out,
        BuildOptions(seq_len=SEQ_LEN, shards=2),
        val_inputs=[chat / "tquad_enelpi_train.jsonl", chat / "seed_tasks_tr.jsonl"],
    )
    return out


@pytest.fixture(scope="session")
def base_run(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    return init_tiny_base(tmp_path_factory.mktemp("base") / "base", corpus, TINY, seed=1)


def write_config(
    path: Path, corpus: Path, base_run: Path, run_dir: Path, **sections: dict[str, Any]
) -> Path:
    """An SFT YAML: BASE_SETTINGS with per-section overrides."""
    doc: dict[str, Any] = {**sft_paths(run_dir, base_run, corpus)}
    for section in {**BASE_SETTINGS, **sections}:
        doc[section] = {**BASE_SETTINGS.get(section, {}), **sections.get(section, {})}
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


@pytest.fixture
def make_config(corpus: Path, base_run: Path, tmp_path: Path) -> Callable[..., Path]:
    """``make_config(name, **sections)`` -> config path whose run dir is tmp_path/name."""

    def make(name: str = "run", **sections: dict[str, Any]) -> Path:
        return write_config(
            tmp_path / f"{name}.yaml", corpus, base_run, tmp_path / name, **sections
        )

    return make


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Job:
    """Trainer processes (one per rank) started in their own session, output to files."""

    def __init__(
        self,
        config: Path,
        *,
        world_size: int = 1,
        env: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
        before_exec: dict[int, Callable[[], None]] | None = None,
    ) -> None:
        """``before_exec``: per rank, run in the child before the trainer starts (a limit)."""
        self.config = config
        self.run_dir = Path(yaml.safe_load(config.read_text(encoding="utf-8"))["run_dir"])
        port = free_port()
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        stamp = time.monotonic_ns()
        for rank in range(world_size):
            penv = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "PYTHONWARNINGS": "ignore",
                "NEDOLM_DIST_TIMEOUT_S": "60",
                **(env or {}),
            }
            if world_size > 1:
                penv |= {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(world_size),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                }
            cmd = [sys.executable, "-m", "nedolm.train", str(config), *args]
            log = config.parent / f"{config.stem}-{stamp}-rank{rank}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    cmd,
                    env=penv,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=(before_exec or {}).get(rank),
                )
            self.procs.append(proc)
            self.logs.append(log)

    def output(self, rank: int = 0) -> str:
        return self.logs[rank].read_text(encoding="utf-8", errors="replace")

    def signal(self, signum: int) -> None:
        """Send ``signum`` to every rank's whole process group (main process and workers)."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)

    def wait(self, timeout: float = PROCESS_TIMEOUT_S) -> list[int]:
        """Exit codes; a job still running after ``timeout`` is killed and fails the test."""
        deadline = time.monotonic() + timeout
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                tails = "\n".join(self.output(r)[-2000:] for r in range(len(self.procs)))
                pytest.fail(f"trainer hung for {timeout}s:\n{tails}")
        return codes

    def wait_ok(self, timeout: float = PROCESS_TIMEOUT_S) -> None:
        codes = self.wait(timeout)
        assert codes == [0] * len(codes), "\n".join(
            self.output(r)[-4000:] for r in range(len(codes))
        )

    def wait_for(self, predicate: Callable[[], bool], what: str, timeout: float = 120) -> None:
        """Poll until ``predicate()``; fail if the job exits or time runs out first."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if any(p.poll() is not None for p in self.procs):
                pytest.fail(f"job exited before {what}:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                self.signal(signal.SIGKILL)
                pytest.fail(f"timed out waiting for {what}")
            time.sleep(0.02)

    def wait_for_step(self, step: int) -> None:
        self.wait_for(lambda: logged_step(self.run_dir) >= step, f"step {step}")

    def kill_9_frozen(self) -> int:
        """SIGKILL every rank's process group while the ranks are frozen, so at a known point:
        right after the last step they had logged, which it returns."""
        with all_frozen(*(proc.pid for proc in self.procs)):
            logged = logged_step(self.run_dir)
            self.signal(signal.SIGKILL)
        return logged

    def wait_for_log(self, needle: str) -> None:
        log = self.run_dir / "train.log"
        self.wait_for(
            lambda: log.exists() and needle in log.read_text(encoding="utf-8"), repr(needle)
        )


def logged_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [0]
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line being written right now
            steps.append(int(json.loads(line).get("step", 0)))
    return max(steps)


def left_by_kill_9(logged: int, ckpt_interval: int) -> tuple[int, int]:
    """The steps a run killed right after logging step ``logged`` may resume from: a step is
    logged before its checkpoint is started, which is written in the background, so the newest
    one due may be unfinished and the one before it is left."""
    newest_due = logged // ckpt_interval * ckpt_interval
    return newest_due - ckpt_interval, newest_due


def step_losses(run_dir: Path) -> dict[int, float]:
    """Training loss per step; a step logged twice (re-run after a kill) keeps the last."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    path = latest_checkpoint(run_dir)
    assert path is not None, f"no checkpoint in {run_dir}"
    return load_checkpoint(path)["model"]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def _reference_recipe_run(
    root: Path,
    corpus: Path,
    base_run: Path,
    env: dict[str, str] | None = None,
    optim: dict[str, Any] | None = None,
) -> Path:
    """Train the reference recipe uninterrupted (checkpoint at the epoch end) in ``root``."""
    config = write_config(
        root / "ref.yaml",
        corpus,
        base_run,
        root / "run",
        train={"ckpt_interval": EPOCH_STEPS, "keep_last": 5},
        optim=optim or {},
    )
    Job(config, env=env).wait_ok()
    return root / "run"


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path, base_run: Path) -> Path:
    """The uninterrupted run every resume is compared with."""
    return _reference_recipe_run(tmp_path_factory.mktemp("reference"), corpus, base_run)


@pytest.fixture(scope="session")
def unclipped_reference(
    tmp_path_factory: pytest.TempPathFactory, corpus: Path, base_run: Path
) -> Path:
    """The reference recipe with ``UNCLIPPED`` optim settings, trained by this trainer."""
    root = tmp_path_factory.mktemp("unclipped")
    return _reference_recipe_run(root, corpus, base_run, optim=UNCLIPPED)


@pytest.fixture(scope="session")
def legacy_run(tmp_path_factory: pytest.TempPathFactory, corpus: Path, base_run: Path) -> Path:
    """``unclipped_reference`` trained by the packages as of ``LEGACY_COMMIT`` (from git), so
    its checkpoints are format version 1 exactly as the old code wrote them."""
    root = tmp_path_factory.mktemp("legacy")
    sources = [f"packages/{name}/src" for name in ("nedolm-data", "nedolm-dist", "nedolm-model")]
    sources.append("packages/nedolm-train/src")
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", LEGACY_COMMIT, *sources],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    # The old nedolm.data was a namespace package, and Python prefers a regular package (today's,
    # installed) to namespace portions wherever they are on the path: an empty __init__ makes
    # the old one regular too, so the first on the path, the old one, is imported.
    for package in root.glob("packages/*/src/nedolm/*"):
        if package.is_dir():
            (package / "__init__.py").touch(exist_ok=True)
    pythonpath = os.pathsep.join(str(root / source) for source in sources)
    old_base = _legacy_base_run(base_run, root / "base")
    return _reference_recipe_run(
        root, corpus, old_base, env={"PYTHONPATH": pythonpath}, optim=UNCLIPPED
    )


def _legacy_base_run(base_run: Path, into: Path) -> Path:
    """``base_run`` as the old trainer reads it: the same weights, and a config without the
    model keys added since (each at its default, so the same model)."""
    shutil.copytree(base_run, into)
    config = yaml.safe_load((into / "config.yaml").read_text(encoding="utf-8"))
    for key, default in MODEL_KEYS_SINCE_LEGACY.items():
        assert config["model"].pop(key) == default, key
    (into / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return into


def copy_checkpoint(run_dir: Path, step: int, into: Path) -> None:
    """Seed a fresh run dir with one checkpoint of another run (a resume from exactly there)."""
    target = into / "checkpoints"
    target.mkdir(parents=True)
    shutil.copy2(run_dir / "checkpoints" / f"step-{step:08d}.pt", target)


@pytest.fixture(scope="session")
def harness() -> SimpleNamespace:
    """The helpers above, for test modules (importlib mode cannot import conftest by name)."""
    return SimpleNamespace(
        Job=Job,
        step_losses=step_losses,
        final_weights=final_weights,
        assert_same_weights=assert_same_weights,
        copy_checkpoint=copy_checkpoint,
        UNCLIPPED=UNCLIPPED,
        write_config=write_config,
        logged_step=logged_step,
        left_by_kill_9=left_by_kill_9,
        EPOCH_STEPS=EPOCH_STEPS,
        MAX_STEPS=MAX_STEPS,
        SEQ_LEN=SEQ_LEN,
        VAL_SHARD=VAL_SHARD,
        TINY=TINY,
    )
