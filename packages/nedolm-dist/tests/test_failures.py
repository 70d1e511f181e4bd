"""A peer that dies (SIGKILL) or hangs while the others wait in a collective becomes an error
on the survivors within the configured timeout, and cleanup still returns: no rank hangs."""

from __future__ import annotations

import time

import pytest

from nedolm.dist.liveness import ROLL_CALL_S

TIMEOUT_S = 10.0  # NEDOLM_DIST_TIMEOUT_S given to the group
SLACK_S = 10.0  # process scheduling on busy CI cores


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "victim"), [(2, 0), (3, 2)], ids=["2ranks-kill-rank0", "3ranks-kill-rank2"]
)
def test_killed_peer_becomes_error_on_survivors(
    start_group, tmp_path, world_size: int, victim: int
) -> None:
    survivors = [rank for rank in range(world_size) if rank != victim]
    with start_group(
        tmp_path, world_size, "wait_in_collective", str(victim), "sum_all", timeout_s=TIMEOUT_S
    ) as group:
        for rank in range(world_size):
            group.wait_for_file(f"ready{rank}", deadline_s=90)
        time.sleep(1.0)  # survivors are now blocked inside sum_all
        group.kill(victim)
        killed_at = time.time()
        group.wait(survivors, deadline_s=TIMEOUT_S + SLACK_S + ROLL_CALL_S)
        for rank in survivors:
            report = group.report(rank)
            assert report["waited"]["error"] == "CollectiveError", report
            assert report["waited"]["message"].startswith(
                f"sum_all: collective failed on rank {rank} (a peer may have died"
            )
            assert report["error_at"] - killed_at < TIMEOUT_S + SLACK_S
            assert "error" not in report["cleanup"] and report["cleaned_up"] is True
            lost = report["lost"]
            assert lost["error"] == "PeerLostError", report
            if victim == 0:  # a plain launch: rank 0 hosted the store, so the roll call fails too
                assert lost["message"].startswith(
                    f"rank {rank}: lost contact with the job: the rendezvous store is unreachable"
                ), lost
            else:  # a survivor that failed later than the roll call's grace may be named too
                named = lost["message"].split("lost rank ", 1)[1].split(" (", 1)[0].split(", ")
                assert (
                    lost["message"].startswith(f"rank {rank}: lost rank ") and str(victim) in named
                )


@pytest.mark.slow
def test_stalled_peer_times_out_instead_of_hanging(start_group, tmp_path) -> None:
    # Rank 1 never enters the collective but stays alive, so no socket closes: only the
    # process-group timeout can release rank 0.
    timeout_s = 4.0
    with start_group(
        tmp_path, 2, "wait_in_collective", "1", "sync_control_flags", timeout_s=timeout_s
    ) as group:
        group.wait([0], deadline_s=90)
        waited = group.report(0)["waited"]
        assert waited["error"] == "CollectiveError", waited
        assert waited["message"].startswith("sync_control_flags: collective failed on rank 0")
        assert timeout_s * 0.9 <= waited["seconds"] < timeout_s + SLACK_S
