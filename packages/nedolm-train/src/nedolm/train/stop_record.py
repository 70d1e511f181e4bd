"""The stop record: proof, left in the run directory, that a stop request ended the job cleanly.

A launcher that forwards a signal to its workers (torchrun's elastic agent) cannot tell from
their exit alone whether they stopped on a consistent checkpoint, and torch reports the signal
as its own failure. So after every rank has returned from the loop on the agreed stop step
(the final checkpoint written and fenced), rank 0 writes ``run_dir/stop.json`` atomically (also
at the end of training with a final checkpoint: a signal that reaches the launcher after the
ranks' last stop check then still finds the job ended cleanly):
the step and the launch id of every rank's launcher (``NEDOLM_LAUNCH_ID``, one per node), so
a record left by an earlier job is never taken for this one's. The launcher then accepts the
stop only if the record names its launch and the newest valid checkpoint is that step's.
A job stopped before its first step records the step it would have started from (``trained``
false): its newest checkpoint is then that step's, or there is none at step 0.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from nedolm.data.atomic import atomic_write_bytes
from nedolm.dist import DistInfo, gather_object, main_rank_call
from nedolm.train.checkpoint import CheckpointError, checkpoint_step, latest_checkpoint

STOP_RECORD = "stop.json"
LAUNCH_ID_ENV = "NEDOLM_LAUNCH_ID"


@dataclass(frozen=True)
class CleanStop:
    """What a verified stop record says."""

    step: int
    """The step of the newest checkpoint (0 and none when the run never trained a step)."""
    trained: bool
    """False when the job stopped before its first step, so it saved nothing."""


def record_stop(info: DistInfo, run_dir: Path, step: int, *, trained: bool = True) -> None:
    """Collective: every rank reports in, then rank 0 writes the stop record of ``step``.

    ``trained=False``: the job stopped before its first step, at ``step`` (a resume's start).
    """
    launch_ids = gather_object(os.environ.get(LAUNCH_ID_ENV, ""))
    record = {
        "step": step,
        "trained": trained,
        "world_size": info.world_size,
        "launch_ids": sorted(set(launch_ids)),
    }
    text = json.dumps(record, indent=2) + "\n"
    main_rank_call(
        info,
        f"write stop record at step {step}",
        lambda: atomic_write_bytes(Path(run_dir) / STOP_RECORD, text.encode("utf-8")),
    )


class UncleanStop(RuntimeError):
    """The job did not stop cleanly; the message says why in one line."""


def verify_stop(run_dir: Path, launch_id: str) -> CleanStop:
    """Where the job launched as ``launch_id`` stopped, cleanly (see the module doc).

    Raises:
        UncleanStop: no record of this launch, or the newest valid checkpoint is not the
            record's step (or there is none, after step 0).
    """
    path = Path(run_dir) / STOP_RECORD
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        launch_ids, step = record["launch_ids"], int(record["step"])
        trained = bool(record.get("trained", True))  # records before this field: trained
    except FileNotFoundError:
        raise UncleanStop(
            f"no rank recorded a clean stop in {path} (a rank failed or was killed first)"
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise UncleanStop(f"{path}: not a stop record ({exc!r})") from None
    if launch_id not in launch_ids:
        raise UncleanStop(f"{path} is from an earlier job: this launch recorded no clean stop")
    try:
        newest = latest_checkpoint(run_dir)
    except CheckpointError as exc:
        raise UncleanStop(str(exc)) from exc
    if (0 if newest is None else checkpoint_step(newest)) != step:
        raise UncleanStop(
            f"the ranks stopped at step {step} but the newest valid checkpoint is {newest}"
        )
    return CleanStop(step, trained)


def left_behind(run_dir: Path) -> str:
    """The checkpoint a re-run would resume from, in words (after an abort)."""
    try:
        newest = latest_checkpoint(run_dir)
    except CheckpointError as exc:
        return f"no valid checkpoint is left ({exc})"
    if newest is None:
        return f"no checkpoint is left in {run_dir}; a re-run starts from the base"
    return f"the newest valid checkpoint is {newest}; a re-run resumes from it"
