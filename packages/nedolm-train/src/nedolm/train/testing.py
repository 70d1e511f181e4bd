"""Support for tests that train for real: a random ``tiny`` base for a corpus and SFT YAMLs for
it, a multi-rank job under a launcher (torchrun, ``nedolm-sft launch``) in its own session with
its output in a file, a rank's process found by its environment and its state read from /proc,
processes frozen while a test reads and signals them, waits that end a hung job instead of
hanging the test run, whether an entry point installs its stop handlers before it imports
torch, and the aten ops a block runs (its host reads among them).

Shipped with the package so that the fault tests of every package (and users' own) drive jobs
the same way; nothing here is used by training itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from nedolm.data.format import read_special_tokens
from nedolm.data.tokenizer import load_tokenizer
from nedolm.train.base import init_base
from nedolm.train.metrics import read_metrics


class OpNames(TorchDispatchMode):
    """The aten ops run inside it, by name: ``names.count("_local_scalar_dense")`` is how often
    the host read a tensor's value (on CUDA, a wait for the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


JOB_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
"""One thread per rank (the test machine's cores are shared by every rank) and quiet logs."""

CLI_ENV = {**JOB_ENV, "PATH": "/usr/bin:/bin"}
"""The whole environment of a quiet ``nedolm-sft`` process: nothing inherited from the test's."""

SMALL_BASE = {"d_model": 64, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 96}
"""``init_tiny_base`` overrides for the smallest base a run test trains: one 64-wide layer, two
query heads sharing one KV head."""


def init_tiny_base(out: Path, corpus: Path, overrides: dict[str, int], seed: int = 0) -> Path:
    """A random base run of the ``tiny`` preset in ``out`` for ``corpus``'s vocabulary and EOS."""
    special = read_special_tokens(corpus)
    init_base(
        out,
        preset_name="tiny",
        vocab_size=special.vocab_size,
        eos_id=special.eos_id,
        seed=seed,
        overrides=overrides,
    )
    return out


def set_options(overrides: dict[str, int]) -> list[str]:
    """``overrides`` as ``--set KEY=VALUE`` options, as ``init-base`` and ``run`` take them."""
    return [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]


class JobFailed(AssertionError):
    """The job exited, hung or never reached what the test waited for; carries its output."""


class LaunchedJob:
    """``cmd`` (a launcher starting the ranks of ``config``'s run) with stdout and stderr in a
    log file beside ``config``; the run directory is ``config`` without its suffix."""

    def __init__(self, cmd: Sequence[str], config: Path, env: dict[str, str] | None = None) -> None:
        self.run_dir = config.with_suffix("")
        self.log = config.parent / f"{config.stem}-job-{time.monotonic_ns()}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                list(cmd),
                env={**os.environ, **JOB_ENV, **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a SIGKILL of the group ends the ranks too
            )

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def rank_pid(self, rank: int) -> int:
        """The worker process of ``rank``: the launcher's child whose environment says so."""
        pid = self.proc.pid
        for child in map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split()):
            with contextlib.suppress(FileNotFoundError):
                if f"RANK={rank}".encode() in Path(f"/proc/{child}/environ").read_bytes().split(
                    b"\0"
                ):
                    return child
        raise JobFailed(f"no worker with RANK={rank} under the launcher {pid}")

    def logged_step(self) -> int:
        """The last step in the run's metrics.jsonl (0 before the first)."""
        return max([0] + [r["step"] for r in read_metrics(self.run_dir)])

    def wait_for_step(self, step: int, timeout: float = 180) -> None:
        """Poll until the job has logged ``step``; it must not exit first."""
        self.wait_for(lambda: self.logged_step() >= step, f"step {step}", timeout)

    def wait_for(self, reached: Callable[[], bool], what: str, timeout: float = 60) -> None:
        """Poll until ``reached()``; the job must not exit first. ``what`` names it in errors."""
        deadline = time.monotonic() + timeout
        while not reached():
            if self.proc.poll() is not None:
                raise JobFailed(f"the job exited before {what}:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise JobFailed(f"no {what} in {timeout:.0f} s:\n{self.output()[-3000:]}")
            time.sleep(0.05)

    def wait(self, timeout: float = 240) -> int:
        """The launcher's exit status; a job still running after ``timeout`` is killed."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise JobFailed(f"the job hung for {timeout:.0f} s:\n{self.output()[-3000:]}") from None

    def wait_ok(self) -> None:
        code = self.wait()
        if code != 0:
            raise JobFailed(f"the job exited {code}:\n{self.output()[-4000:]}")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def process_state(stat: Path) -> str | None:
    """The one-letter state (R, S, T, t, Z, X, ...) in a ``/proc/PID[/task/TID]/stat`` file;
    None once the process or thread is gone."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0]  # after the command's parentheses
    except FileNotFoundError:
        return None


def process_running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its parent to reap it has ended)."""
    return process_state(Path(f"/proc/{pid}/stat")) not in (None, "Z", "X")


def frozen(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (by SIGSTOP); one that has just ended counts."""
    states = (process_state(task / "stat") for task in Path(f"/proc/{pid}/task").iterdir())
    return all(state in (None, "t", "T") for state in states)


def pending_signals(pid: int) -> set[signal.Signals]:
    """The signals sent to ``pid`` and not yet handled (a stopped process keeps them): sent to
    the thread (SigPnd) or to the process (ShdPnd)."""
    return _signal_masks(pid, "SigPnd", "ShdPnd")


def caught_signals(pid: int) -> set[signal.Signals]:
    """The signals ``pid`` has installed a handler for (SigCgt): from then on one of them no
    longer kills it with the default action."""
    return _signal_masks(pid, "SigCgt")


def _signal_masks(pid: int, *fields: str) -> set[signal.Signals]:
    """The union of ``/proc/PID/status``'s signal masks ``fields`` (bit n-1 for signal n)."""
    mask = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in fields:
            mask |= int(value, 16)
    return {sig for sig in signal.Signals if mask >> (sig - 1) & 1}


# Runs ``python -m MODULE ARGS`` with ``StopRequest.install`` wrapped to record whether torch
# had been imported at each call; prints the record as JSON however the module ends.
_TORCH_AT_STOP_INSTALLS = """
import json, runpy, sys
from nedolm.train.signals import StopRequest
install, torch_loaded = StopRequest.install, []
def recording(self):
    torch_loaded.append("torch" in sys.modules)
    return install(self)
StopRequest.install = recording
sys.argv = sys.argv[1:]
try:
    runpy.run_module(sys.argv[0], run_name="__main__")
finally:
    print(json.dumps(torch_loaded))
"""


def torch_at_stop_installs(module: str, *args: str) -> list[bool]:
    """Whether torch had been imported each time ``python -m MODULE ARGS`` installed its stop
    handlers: a signal in torch's seconds-long import is kept only if the first is False."""
    done = subprocess.run(
        [sys.executable, "-c", _TORCH_AT_STOP_INSTALLS, module, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if not done.stdout.strip():
        raise JobFailed(f"python -m {module} printed no record:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


@contextlib.contextmanager
def all_frozen(*pids: int, timeout: float = 30) -> Iterator[None]:
    """Every thread of each of ``pids`` stopped inside the block and continued after it, so that
    what the test reads and sends there happens at one point of their progress: a signal sent
    inside stays pending until the block ends, after what was read (a test process scheduled
    late can otherwise read a step and signal the job some steps further on)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout
        while not all(frozen(pid) for pid in pids):
            if ended := [pid for pid in pids if not process_running(pid)]:
                raise JobFailed(f"processes {ended} ended before they could be frozen")
            if time.monotonic() > deadline:
                raise JobFailed(f"processes {pids} not all stopped after {timeout:.0f} s")
            time.sleep(0.01)
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def sft_paths(run_dir: Path, base: Path, corpus: Path) -> dict[str, str]:
    """The path keys of an SFT YAML: a run in ``run_dir`` of the base run ``base`` on the
    prepared ``corpus``."""
    return {
        "run_dir": str(run_dir),
        "base_config": str(base / "config.yaml"),
        "base_run_dir": str(base),
        "data_dir": str(corpus),
    }


# Room for a test that signals "after step 2" of 0.3 s steps: its signal lands after the last
# step only if the test process stalls for ~10 s.
STOP_TEST_MAX_STEPS = 40


def write_sft_config(path: Path, corpus: Path, base: Path, **sections: object) -> Path:
    """An SFT YAML at ``path`` for a run of the base run ``base`` on ``corpus``, its run dir
    ``path`` without its suffix, with the config's other ``sections`` (``optim``, ``train``…)."""
    doc = {**sft_paths(path.with_suffix(""), base, corpus), **sections}
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def write_stop_test_config(path: Path, corpus: Path, base: Path, **train: object) -> Path:
    """A small SFT YAML for signal tests, its run dir ``path`` without its suffix:
    ``STOP_TEST_MAX_STEPS`` eager steps of one 256-token window, a stop honoured at every step,
    no validation; ``train`` overrides."""
    return write_sft_config(
        path,
        corpus,
        base,
        optim={"lr": 3e-3, "warmup_steps": 2},
        train={
            "seq_len": 256,
            "micro_batch_size": 1,
            "grad_accum_steps": 1,
            "max_steps": STOP_TEST_MAX_STEPS,
            "num_workers": 0,
            "compile": False,
            "compile_backend": "aot_eager",
            "log_interval": 1,
            "control_interval": 1,
            "ckpt_interval": 1000,
            **train,
        },
        validation={"enabled": False},
    )


@contextlib.contextmanager
def mounted_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` (e.g. "4m") mounted on ``mount_point`` for the block: a disk that
    fills up. Needs root (the tests run as root); without it, fails saying so."""
    mount_point.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        raise JobFailed(f"cannot mount a tmpfs (root needed): {mounted.stderr}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def save_tiny_hf_llama(out: Path, tokenizer_json: bytes, **config: object) -> Path:
    """A tiny random Llama saved by transformers beside ``tokenizer_json`` in ``out``, as a
    model directory on the hub looks (untied, 2 layers of width 64); ``config`` overrides
    ``LlamaConfig`` fields. Needs transformers (a test dependency)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True)
    (out / "tokenizer.json").write_bytes(tokenizer_json)
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    fields: dict[str, object] = {
        "vocab_size": load_tokenizer(out).base_vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**fields, **config})).save_pretrained(out)
    return out
