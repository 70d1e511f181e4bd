"""``nedolm-sft launch``: torchrun for this job, exiting 0 when a signal stopped it cleanly.

torchrun's elastic agent forwards SIGTERM (and the other signals it handles) to the workers,
waits up to ``--shutdown-timeout`` seconds for them (a fixed 30 s on torch 2.10, whose torchrun
lacks the option; then SIGKILLs them) and exits 1 with its own SignalException, even when every
rank stopped on a consistent checkpoint. This command runs that same agent in this process
(torch's own parser, rendezvous and worker management), so the process a scheduler signals is
the agent; when it raises, the stop record that rank 0 writes after a clean stop
(``nedolm.train.stop_record``) decides the exit status.

Two gaps of torch's handling are closed here (``_LauncherSignals``). Before the agent starts the
workers it has no handlers, so a signal then (the CLI keeps one that came during the imports)
ends the launch with exit 0 and "before any rank started". And a second Ctrl-C would only
make the agent wait for the workers' clean stop again (they run in sessions of their own, so
a terminal's Ctrl-C reaches this process alone): SIGINT stays this module's, the first is
forwarded as the agent would, the second is passed on to the workers, which abort, and the
launch exits 130 naming the checkpoint left.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import click
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from nedolm.data.atomic import process_alive
from nedolm.dist import LAUNCHER_PID_ENV
from nedolm.train.signals import claim, tell
from nedolm.train.stop_record import LAUNCH_ID_ENV, UncleanStop, left_behind, verify_stop
from nedolm.train.trainer import smoke_run_dir
from nedolm_sft.commands.train import config_to_run, run

# torchrun's default signals plus SIGUSR1, SLURM's usual pre-emption warning; the workers
# treat SIGTERM and SIGUSR1 as a stop request. ``--signals-to-handle`` still overrides this.
HANDLED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SCRATCH_PREFIX = "nedolm-launch-"  # then "<host>-<launcher pid>-<random>" (`_scratch_log_dir`)


@click.command(
    "launch",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.argument(
    "argv", nargs=-1, type=click.UNPROCESSED, metavar="[TORCHRUN OPTIONS] CONFIG [RUN OPTIONS]"
)
def launch(argv: tuple[str, ...]) -> None:
    """Start "nedolm-sft run CONFIG [RUN OPTIONS]" on every rank, like torchrun.

    Takes torchrun's options (see torchrun --help); RUN OPTIONS (--set, --print-config,
    --no-compile, ...) go to every rank's run. A signal to this process (SIGTERM,
    SIGUSR1, Ctrl-C, ...) stops every rank on one checkpoint: exit 0 when that worked (or when
    it came before the first step: nothing to save), else 128 + the signal number with the
    reason. A second Ctrl-C aborts (exit 130). A failed rank exits 1.

    \b
    Example:
      nedolm-sft launch --standalone --nproc-per-node 8 examples/sft.yaml
      nedolm-sft launch --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d \\
          --rdzv-endpoint head:29500 --rdzv-id job42 examples/sft.yaml --no-compile
    """
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", HANDLED_SIGNALS)  # torchrun's own env default
    parser = torchrun.get_args_parser()
    parser.prog = "nedolm-sft launch"
    args = parser.parse_args(list(argv))
    if args.module or args.no_python or args.run_path:
        raise click.UsageError(
            "launch always starts `nedolm-sft run CONFIG`: drop -m/--no-python/--run-path"
        )
    config = Path(args.training_script)
    # The run options as every rank's `nedolm-sft run` will read them: a bad one fails here.
    with run.make_context("nedolm-sft run", [str(config), *args.training_script_args]) as ctx:
        options = ctx.params
    cfg = config_to_run(
        config,
        options["overrides"],
        trust_unverified=options["trust_unverified"],
        print_config=options["print_config"],
    )
    if cfg is None:
        return
    smoke = options["smoke_steps"] is not None
    run_dir = smoke_run_dir(cfg.run_dir) if smoke else cfg.run_dir  # where the ranks write
    launch_id = uuid.uuid4().hex
    os.environ[LAUNCH_ID_ENV] = launch_id  # inherited by this node's workers
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the workers stop when this process dies
    args.module, args.training_script = True, "nedolm_sft"
    args.training_script_args = ["run", str(config), *args.training_script_args]
    signals = _LauncherSignals(args)
    early = claim()  # the CLI's handlers, installed before the imports
    if early.requested:
        _stopped_before_start(early.describe())
        return
    with _scratch_log_dir(args):
        _run_agent(args, signals, run_dir, launch_id)


def _run_agent(
    args: argparse.Namespace, signals: _LauncherSignals, run_dir: Path, launch_id: str
) -> None:
    """torch's agent runs the ranks; its SignalException and ChildFailedError become this
    command's exit status and message."""
    try:
        torchrun.run(args)
    except SignalException as exc:
        signal_name = (signals.first or exc.sigval).name
        if signals.before_start:
            _stopped_before_start(signal_name)
            return
        if signals.interrupts > 1:
            tell(f"launch: aborted by a second SIGINT: {left_behind(run_dir)}")
            sys.exit(128 + signal.SIGINT)
        try:
            stop = verify_stop(run_dir, launch_id)
        except UncleanStop as unclean:
            tell(f"launch: {signal_name}: the job did not stop cleanly: {unclean}")
            tell(f"launch: {left_behind(run_dir)}")  # where a re-run resumes, in every case
            sys.exit(128 + exc.sigval)
        if stop.trained:
            where = f"stopped at step {stop.step} on a valid checkpoint"
        else:
            where = f"stopped before step {stop.step + 1}; nothing to save"
        tell(f"launch: {signal_name}: every rank {where}; re-run the same command to resume")
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise click.ClickException(
            f"rank {rank} failed first (exit code {failure.exitcode}; its log is above); "
            "fix the cause and re-run the same command to resume from the last checkpoint"
        ) from exc


@contextlib.contextmanager
def _scratch_log_dir(args: argparse.Namespace) -> Iterator[None]:
    """Give torch's agent a log directory that goes when the launch does.

    Without ``--log-dir`` torchrun makes a ``torchelastic_*`` tree under the temporary
    directory for every launch (a folder per rank, for ``--redirects``/``--tee`` logs and
    error files) and never removes it: on a shared node they pile up. The launch makes that
    tree itself and removes it at the end when nothing was written into it; where something
    was, the user asked for it, so it stays and is named (torch logs where only at INFO).
    """
    if args.log_dir is not None or args.logs_specs is not None:  # the user's: theirs to keep
        yield
        return
    host = socket.gethostname()
    _remove_abandoned_scratch(Path(tempfile.gettempdir()), host)
    scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{host}-{os.getpid()}-"))
    args.log_dir = str(scratch)
    try:
        yield
    finally:
        if _holds_files(scratch):
            tell(f"launch: torchrun's per-rank logs are in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def _remove_abandoned_scratch(temp_dir: Path, host: str) -> None:
    """Remove the empty log folders of this host's launches that were killed outright.

    A launch killed with SIGKILL (a scheduler's last resort) cannot remove its folder. Its name
    carries the host and the launcher's pid, so a later launch removes it once that pid is
    gone, if it is this user's and holds no file (a log is the user's: it stays, as above).
    """
    named = re.compile(rf"{re.escape(SCRATCH_PREFIX + host)}-(\d+)-\w+")
    for folder in temp_dir.glob(f"{SCRATCH_PREFIX}*"):
        match = named.fullmatch(folder.name)
        if match is None or process_alive(int(match[1])):
            continue
        with contextlib.suppress(FileNotFoundError):  # another launch removed it first
            if folder.stat().st_uid == os.getuid() and not _holds_files(folder):
                shutil.rmtree(folder, ignore_errors=True)


def _holds_files(folder: Path) -> bool:
    """Whether torch's agent wrote a file (a log, an error file) anywhere under ``folder``."""
    return any(path.is_file() for path in folder.rglob("*"))


class _LauncherSignals:
    """This process's handlers for torch's signals until the agent installs its own (when it
    starts the workers), and for SIGINT throughout (see the module doc)."""

    def __init__(self, args: argparse.Namespace) -> None:
        names = [name.strip() for name in args.signals_to_handle.split(",")]
        handled = [signal.Signals[name] for name in names if name]
        self.torch_signals = [s for s in handled if s != signal.SIGINT]
        args.signals_to_handle = ",".join(s.name for s in self.torch_signals)
        self.first: signal.Signals | None = None
        self.before_start = False
        self.interrupts = 0
        for signum in handled:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        received = signal.Signals(signum)
        if received == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:  # the agent is waiting for the workers' stop: abort it
                _signal_children(signal.SIGINT)
                return
        if self.first is None:
            self.first = received
            self.before_start = not self._agent_handles_signals()
        raise SignalException(f"Process {os.getpid()} got signal: {received}", sigval=received)

    def _agent_handles_signals(self) -> bool:
        return any(signal.getsignal(s) != self._handle for s in self.torch_signals)


def _signal_children(signum: int) -> None:
    """Send ``signum`` to this process's children: the workers the agent started (Linux)."""
    for children in Path("/proc/self/task").glob("*/children"):
        for pid in children.read_text(encoding="ascii").split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signum)


def _stopped_before_start(reason: str) -> None:
    tell(
        f"launch: {reason}: stopped before any rank started; nothing to save; "
        "re-run the same command to start"
    )
