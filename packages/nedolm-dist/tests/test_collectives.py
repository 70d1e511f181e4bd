"""Every rank-safe helper in real gloo groups of 2 (torchrun env) and 3 (SLURM env) ranks.

One group per world size runs all checks (dist_worker.collectives) and reports what each rank
saw; the check_* functions compare those reports with answers computed here. Failures are injected
on rank 0, on the last rank and on every rank; each must surface as the same RankError on
every rank, naming exactly the failing ranks and their messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

LAUNCHERS = {2: "torchrun", 3: "slurm"}
MAX_CALL_SECONDS = 30.0
UNPICKLABLE = r"not picklable: AttributeError: Can't (pickle|get) local object"
"""Pickling a local lambda, as the helpers report it (Python 3.13 says "get", earlier "pickle")."""


@dataclass
class Run:
    world_size: int
    reports: list[dict]

    @property
    def ranks(self) -> range:
        return range(self.world_size)

    def sites(self) -> dict[str, list[int]]:
        return self.reports[0]["failure_sites"]

    def outcomes(self, key: str) -> list[dict]:
        found = [report[key] for report in self.reports]
        for rank, result in enumerate(found):
            assert result["seconds"] < MAX_CALL_SECONDS, f"{key} took {result} on rank {rank}"
        return found


def assert_rank_error_everywhere(results: list[dict], expected_message: str) -> None:
    for rank, result in enumerate(results):
        assert result.get("error") == "RankError", f"rank {rank}: {result}"
        assert result["message"] == expected_message, f"rank {rank}"


def check_setup_reads_launcher_env_and_cleans_up(run: Run) -> None:
    for rank, report in enumerate(run.reports):
        assert report["info"] == [rank, run.world_size, rank, "cpu", rank == 0]
        assert report["get_info"] is True
        assert report["queries"] == [rank, run.world_size, rank == 0, True]
        assert report["barrier"]["value"] is None
        assert report["cleaned_up"] is True


def check_gather_object(run: Run) -> None:
    for site, failing in run.sites().items():
        results = run.outcomes(f"gather_object/{site}")
        if not failing:
            expected = [{"rank": rank, "square": rank * rank} for rank in run.ranks]
            assert [r.get("value") for r in results] == [expected] * run.world_size
            continue
        message = results[0]["message"]
        assert message.startswith("gather_object failed: rank ")
        named = [
            part.split(":")[0]
            for part in message.removeprefix("gather_object failed: ").split(" | ")
        ]
        assert named == [f"rank {rank}" for rank in failing], site
        assert re.search(UNPICKLABLE, message)
        assert_rank_error_everywhere(results, message)


def check_main_rank_call(run: Run) -> None:
    for site, failing in run.sites().items():
        results = run.outcomes(f"main_rank_call/{site}")
        ran = [report[f"main_rank_call/{site}/ran_here"] for report in run.reports]
        assert ran == [rank == 0 for rank in run.ranks], f"fn must run on rank 0 only ({site})"
        if 0 in failing:
            expected = "write things failed: rank 0: ValueError: main boom on rank 0"
            assert_rank_error_everywhere(results, expected)
        else:  # a failure injected on a non-zero rank never runs there
            expected = {"computed_on": 0, "items": [1.5, "x", None]}
            assert [r.get("value") for r in results] == [expected] * run.world_size


def check_main_rank_call_unpicklable_result_fails_everywhere(run: Run) -> None:
    results = run.outcomes("main_rank_call/unpicklable")
    message = results[0]["message"]
    assert re.match(f"return a local lambda failed: rank 0: {UNPICKLABLE}", message)
    assert_rank_error_everywhere(results, message)


def check_all_rank_call(run: Run) -> None:
    for site, failing in run.sites().items():
        results = run.outcomes(f"all_rank_call/{site}")
        if not failing:
            assert [r.get("value") for r in results] == [10 * rank for rank in run.ranks]
            continue
        expected = "load shards failed: " + " | ".join(
            f"rank {rank}: ValueError: local boom on rank {rank}" for rank in failing
        )
        assert_rank_error_everywhere(results, expected)


def check_collect_rank_errors(run: Run) -> None:
    for site, failing in run.sites().items():
        expected = [f"rank {rank}: bad input on rank {rank}" for rank in failing]
        results = run.outcomes(f"collect_rank_errors/{site}")
        assert [r.get("value") for r in results] == [expected] * run.world_size, site


def check_sync_control_flags_ors_stop_and_follows_rank0_archive(run: Run) -> None:
    # Non-zero ranks always vote the opposite of rank 0 on archiving; their vote must not count.
    for site, failing in run.sites().items():
        for rank0_archive in (False, True):
            results = run.outcomes(f"sync_control_flags/{site}/archive={rank0_archive}")
            expected = [rank0_archive, bool(failing)]
            assert [r.get("value") for r in results] == [expected] * run.world_size, site


def check_sum_all(run: Run) -> None:
    float_sum = [sum(rank + 1.0 for rank in run.ranks), sum(2.0 * rank for rank in run.ranks)]
    int_sum = [sum(run.ranks), run.world_size]
    assert [r["value"] for r in run.outcomes("sum_all/float")] == [float_sum] * run.world_size
    assert [r["value"] for r in run.outcomes("sum_all/int")] == [int_sum] * run.world_size
    assert all(report["sum_all/in_place"] for report in run.reports)


def check_broadcast_module_state_is_bitwise(run: Run) -> None:
    for src in (0, run.world_size - 1):
        before = [report[f"broadcast_module_state/src={src}/before"] for report in run.reports]
        after = [report[f"broadcast_module_state/src={src}/after"] for report in run.reports]
        assert len(set(before)) == run.world_size, "modules must start different"
        assert after == [before[src]] * run.world_size
        assert all(r["value"] is None for r in run.outcomes(f"broadcast_module_state/src={src}"))


def check_broadcast_module_state_mismatch_fails_everywhere(run: Run) -> None:
    # dist_worker builds Linear(width, 3) with width 5 + rank on failing ranks, else 4.
    for site, failing in run.sites().items():
        width = [5 + rank if rank in failing else 4 for rank in run.ranks]
        differ = [rank for rank in run.ranks if width[rank] != width[0]]
        results = run.outcomes(f"broadcast_module_state/mismatch/{site}")
        if not differ:
            assert all(r.get("value") is None and "error" not in r for r in results), site
            continue
        expected = "broadcast_module_state failed: " + " | ".join(
            f"rank {rank}: module differs: proj.weight [3, {width[rank]}] float32 on cpu here, "
            f"proj.weight [3, {width[0]}] float32 on cpu on rank 0"
            for rank in differ
        )
        assert_rank_error_everywhere(results, expected)


def check_main_rank_filter_logs_info_and_agreed_warnings_on_rank0_only(run: Run) -> None:
    assert run.reports[0]["log_lines"] == [
        "0 INFO child info",
        "0 INFO info",
        "0 WARNING warning",
        "0 WARNING agreed warning",
    ]
    for rank in run.ranks[1:]:
        assert run.reports[rank]["log_lines"] == [f"{rank} WARNING warning"]


CHECKS = [
    check_setup_reads_launcher_env_and_cleans_up,
    check_gather_object,
    check_main_rank_call,
    check_main_rank_call_unpicklable_result_fails_everywhere,
    check_all_rank_call,
    check_collect_rank_errors,
    check_sync_control_flags_ors_stop_and_follows_rank0_archive,
    check_sum_all,
    check_broadcast_module_state_is_bitwise,
    check_broadcast_module_state_mismatch_fails_everywhere,
    check_main_rank_filter_logs_info_and_agreed_warnings_on_rank0_only,
]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", sorted(LAUNCHERS), ids=lambda n: f"{n}ranks")
def test_every_helper_under_injected_failures(start_group, tmp_path, world_size: int) -> None:
    # One group per world size runs every check: process start dominates the cost, and the
    # group stays healthy because each injected failure is exchanged inside a collective.
    launcher = LAUNCHERS[world_size]
    with start_group(tmp_path, world_size, "collectives", launcher=launcher) as group:
        group.wait(list(range(world_size)), deadline_s=120)
        run = Run(world_size, group.reports())
    for check in CHECKS:
        check(run)
