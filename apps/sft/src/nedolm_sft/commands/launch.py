"""``nedolm-sft launch``: torchrun for this job, exiting 0 when a signal stopped it cleanly.

torchrun's elastic agent forwards SIGTERM (and the other signals it handles) to the workers,
waits up to ``--shutdown-timeout`` seconds for them (then SIGKILLs them) and exits 1 with its
own SignalException, even when every rank stopped on a consistent checkpoint. This command runs
that same agent in this process (torch's own parser, rendezvous and worker management), so the
process a scheduler signals is the agent; when it raises, the stop record that rank 0 writes
after a clean stop (``nedolm.train.stop_record``) decides the exit status.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import click
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from nedolm.train.config import ConfigError, dump_config, load_sft_config
from nedolm.train.stop_record import LAUNCH_ID_ENV, UncleanStop, verify_stop

# torchrun's default signals plus SIGUSR1, SLURM's usual pre-emption warning; the workers
# treat SIGTERM and SIGUSR1 as a stop request. ``--signals-to-handle`` still overrides this.
HANDLED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


@click.command(
    "launch",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.argument(
    "argv", nargs=-1, type=click.UNPROCESSED, metavar="[TORCHRUN OPTIONS] CONFIG [RUN OPTIONS]"
)
def launch(argv: tuple[str, ...]) -> None:
    """Start ``nedolm-sft run CONFIG [RUN OPTIONS]`` on every rank, like torchrun.

    Takes torchrun's options (``torchrun --help``). A signal to this process (SIGTERM,
    SIGUSR1, ...) stops every rank on one checkpoint: exit 0 when that worked, else
    128 + the signal number with the reason. A failed rank exits 1.

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
    try:
        cfg = load_sft_config(config, _overrides(args.training_script_args))
    except (ConfigError, OSError) as exc:
        raise click.UsageError(str(exc)) from exc
    if "--print-config" in args.training_script_args:
        click.echo(dump_config(cfg), nl=False)
        return
    launch_id = uuid.uuid4().hex
    os.environ[LAUNCH_ID_ENV] = launch_id  # inherited by this node's workers
    args.module, args.training_script = True, "nedolm_sft"
    args.training_script_args = ["run", str(config), *args.training_script_args]
    try:
        torchrun.run(args)
    except SignalException as exc:
        signal_name = exc.sigval.name
        try:
            step = verify_stop(cfg.run_dir, launch_id)
        except UncleanStop as unclean:
            click.echo(f"launch: {signal_name}: the job did not stop cleanly: {unclean}", err=True)
            sys.exit(128 + exc.sigval)
        click.echo(
            f"launch: {signal_name}: every rank stopped at step {step} on a valid checkpoint; "
            "re-run the same command to resume",
            err=True,
        )
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise click.ClickException(
            f"rank {rank} failed first (exit code {failure.exitcode}; its log is above); "
            "fix the cause and re-run the same command to resume from the last checkpoint"
        ) from exc


def _overrides(run_args: list[str]) -> list[str]:
    """The ``--set KEY=VALUE`` items among the run options, to check the config as run will."""
    items = []
    for i, arg in enumerate(run_args):
        if arg == "--set" and i + 1 < len(run_args):
            items.append(run_args[i + 1])
        elif arg.startswith("--set="):
            items.append(arg.removeprefix("--set="))
    return items
