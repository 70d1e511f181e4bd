"""Launcher env parsing, timeout resolution, and every helper without a process group
(single process) and with a real one-rank gloo group."""

from __future__ import annotations

import datetime
import logging
import re

import pytest
import torch

from nedolm import dist as nd
from nedolm.dist.env import DEFAULT_TIMEOUT, TIMEOUT_ENV, resolve_timeout

RENDEZVOUS = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", **RENDEZVOUS}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "2", **RENDEZVOUS}


def _drop(env: dict[str, str], name: str) -> dict[str, str]:
    return {k: v for k, v in env.items() if k != name}


def test_no_launcher_env_is_single_process() -> None:
    assert nd.read_launch_env({}) is None
    assert nd.read_launch_env({"MASTER_ADDR": "x", "SLURM_JOB_ID": "7"}) is None


def test_torchrun_env() -> None:
    assert nd.read_launch_env(TORCHRUN) == nd.LaunchEnv(3, 8, 1, "torchrun")


def test_slurm_env() -> None:
    assert nd.read_launch_env(SLURM) == nd.LaunchEnv(5, 16, 2, "slurm")


def test_torchrun_inside_slurm_allocation_wins() -> None:
    assert nd.read_launch_env({**SLURM, **TORCHRUN}) == nd.LaunchEnv(3, 8, 1, "torchrun")


def test_one_task_slurm_step_is_single_process() -> None:
    assert nd.read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({**TORCHRUN, "MASTER_ADDR": ""}, "torchrun launch: environment variable MASTER_ADDR"),
        (_drop(TORCHRUN, "MASTER_ADDR"), "environment variable MASTER_ADDR is not set"),
        (_drop(SLURM, "MASTER_ADDR"), "slurm launch: environment variable MASTER_ADDR is not set"),
        (_drop(SLURM, "MASTER_PORT"), "slurm launch: environment variable MASTER_PORT is not set"),
        (_drop(TORCHRUN, "LOCAL_RANK"), "environment variable LOCAL_RANK is not set"),
        (_drop(TORCHRUN, "WORLD_SIZE"), "environment variable WORLD_SIZE is not set"),
        (_drop(SLURM, "SLURM_LOCALID"), "environment variable SLURM_LOCALID is not set"),
        ({**TORCHRUN, "RANK": "one"}, "torchrun launch: RANK='one' is not an integer"),
        ({**SLURM, "MASTER_PORT": "http"}, "slurm launch: MASTER_PORT='http' is not an integer"),
        ({**TORCHRUN, "RANK": "8"}, "torchrun launch: RANK=8 is outside [0, 8)"),
        ({**TORCHRUN, "WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0 must be >= 1"),
        ({**SLURM, "SLURM_LOCALID": "-1"}, "slurm launch: SLURM_LOCALID=-1 must be >= 0"),
    ],
)
def test_bad_launcher_env_names_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(nd.DistEnvError, match=re.escape(message)):
        nd.read_launch_env(env)


def test_timeout_resolution() -> None:
    assert resolve_timeout(None, {}) == DEFAULT_TIMEOUT
    assert resolve_timeout(None, {TIMEOUT_ENV: "12.5"}) == datetime.timedelta(seconds=12.5)
    assert resolve_timeout(3, {TIMEOUT_ENV: "12.5"}) == datetime.timedelta(seconds=3)
    minute = datetime.timedelta(minutes=1)
    assert resolve_timeout(minute, {}) == minute


@pytest.mark.parametrize("raw", ["soon", "0", "-5", "inf", "nan"])
def test_bad_timeout_env_names_the_variable(raw: str) -> None:
    with pytest.raises(nd.DistEnvError, match=f"{TIMEOUT_ENV}="):
        resolve_timeout(None, {TIMEOUT_ENV: raw})


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), datetime.timedelta(0)])
def test_bad_timeout_argument(bad: float | datetime.timedelta) -> None:
    with pytest.raises(ValueError, match="timeout must be a finite number > 0"):
        resolve_timeout(bad, {})


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*TORCHRUN, *SLURM, TIMEOUT_ENV):
        monkeypatch.delenv(name, raising=False)


def test_setup_without_env_is_single_process(no_launcher: None) -> None:
    info = nd.setup_distributed()
    assert info == nd.DistInfo(0, 1, 0, torch.device("cpu")) == nd.get_info()
    assert info.is_main and not nd.is_distributed()
    assert (nd.get_rank(), nd.get_world_size(), nd.is_main_rank()) == (0, 1, True)
    nd.cleanup()
    nd.cleanup()


def test_setup_rejects_unknown_backend_and_bad_env(no_launcher: None, monkeypatch) -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        nd.setup_distributed(backend="mpi")
    for name, value in _drop(TORCHRUN, "MASTER_PORT").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(nd.DistEnvError, match="MASTER_PORT is not set"):
        nd.setup_distributed()


def single_process_helpers(info: nd.DistInfo) -> None:
    """The helpers' contract for a one-rank job; same answers with or without a group."""
    obj = {"a": [1, 2]}
    assert nd.gather_object(obj) == [obj]
    t = torch.tensor([1.5, -2.0])
    assert nd.sum_all(t) is t and t.tolist() == [1.5, -2.0]
    assert nd.main_rank_call(info, "act", lambda: {"x": 1}) == {"x": 1}
    assert nd.all_rank_call(info, "act", lambda: 7) == 7
    assert nd.collect_rank_errors(info, "") == []
    assert nd.collect_rank_errors(info, "disk full") == ["rank 0: disk full"]
    assert nd.sync_control_flags(rank0_archive_due=True, local_stop=False) == (True, False)
    assert nd.sync_control_flags(rank0_archive_due=False, local_stop=True) == (False, True)
    nd.barrier()

    def fail() -> None:
        raise KeyError("missing")

    for helper in (nd.main_rank_call, nd.all_rank_call):
        with pytest.raises(nd.RankError, match=r"^act failed: rank 0: KeyError: 'missing'$") as err:
            helper(info, "act", fail)
        assert isinstance(err.value, RuntimeError) and isinstance(err.value.__cause__, KeyError)
        assert err.value.failures == {0: "KeyError: 'missing'"} and err.value.action == "act"

    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    nd.broadcast_module_state(module)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())

    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", None, None)
    assert nd.MainRankFilter().filter(record) and record.rank == 0


def test_helpers_without_process_group(no_launcher: None) -> None:
    single_process_helpers(nd.setup_distributed())


def test_helpers_in_real_one_rank_group(no_launcher: None, monkeypatch, master_port) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**env, "MASTER_PORT": str(master_port)}.items():
        monkeypatch.setenv(name, value)
    info = nd.setup_distributed(backend="gloo", timeout=20)
    try:
        assert nd.is_distributed() and info == nd.get_info()
        assert info == nd.DistInfo(0, 1, 0, torch.device("cpu"))
        with pytest.raises(RuntimeError, match="already initialised"):
            nd.setup_distributed()
        single_process_helpers(info)
        with pytest.raises(nd.RankError, match="rank 0: not picklable"):
            nd.gather_object(lambda: 0)
    finally:
        nd.cleanup()
    nd.cleanup()
    assert not nd.is_distributed()
