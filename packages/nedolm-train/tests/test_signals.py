"""Real signals to this process set the stop request (a second SIGINT aborts), each saying so in
one line; the fault hooks parse strictly."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from nedolm.train.faults import InjectedFault, maybe_inject
from nedolm.train.signals import StopRequest, claim, install_early
from nedolm.train.testing import torch_at_stop_installs


def deliver(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.01)  # CPython runs the handler at the next bytecode boundary


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_signal_sets_the_stop_request_and_says_so_once(
    signum: int, capfd: pytest.CaptureFixture[str]
) -> None:
    stop = StopRequest().install()
    assert not stop.requested and stop.describe() == "requested by another rank"
    deliver(signum)
    name = signal.Signals(signum).name
    assert stop.requested and stop.describe() == name
    stop.request("max_hours")  # the first reason is kept
    assert stop.describe() == name
    [line] = capfd.readouterr().err.splitlines()
    assert line == f"nedolm: {name} received: stopping before training starts; nothing new to save"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_once_training_a_signal_promises_a_checkpoint_after_the_next_step(
    signum: int, capfd: pytest.CaptureFixture[str]
) -> None:
    stop = StopRequest().install()
    stop.training = True  # what the loop sets when it starts stepping
    deliver(signum)
    [line] = capfd.readouterr().err.splitlines()
    name = signal.Signals(signum).name
    assert line.startswith(f"nedolm: {name} received: stopping after the next optimizer step")
    assert "a checkpoint is coming" in line
    assert ("Ctrl-C again aborts" in line) == (signum == signal.SIGINT)


def test_the_second_sigint_aborts_and_a_repeated_sigterm_does_not(
    capfd: pytest.CaptureFixture[str],
) -> None:
    stop = StopRequest().install()
    deliver(signal.SIGTERM)
    deliver(signal.SIGTERM)
    deliver(signal.SIGINT)  # the first Ctrl-C, after a scheduler's stop: still a clean stop
    with pytest.raises(KeyboardInterrupt):
        deliver(signal.SIGINT)
    assert stop.describe() == "SIGTERM"
    assert capfd.readouterr().err.splitlines()[1:] == [
        "nedolm: SIGTERM received: already stopping",
        "nedolm: SIGINT received: already stopping",
        "nedolm: SIGINT again: aborting now, without a checkpoint",
    ]


def test_the_trainer_claims_the_request_installed_early_once() -> None:
    early = install_early()
    deliver(signal.SIGUSR1)
    assert claim() is early and early.requested
    later = claim()  # a second run in this process starts with a fresh request
    assert later is not early and not later.requested
    assert signal.getsignal(signal.SIGTERM) == later._handle


def test_fault_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    maybe_inject("data_fetch", 0)  # unset: nothing happens
    monkeypatch.setenv("NEDOLM_TEST_FAULT", "validation@1,data_fetch@*")
    maybe_inject("validation", 0)
    with pytest.raises(InjectedFault, match="at validation on rank 1"):
        maybe_inject("validation", 1)
    with pytest.raises(InjectedFault, match="at data_fetch on rank 3"):
        maybe_inject("data_fetch", 3)
    monkeypatch.setenv("NEDOLM_TEST_FAULT", "dataload@1")
    with pytest.raises(ValueError, match="NEDOLM_TEST_FAULT: bad entry 'dataload@1'"):
        maybe_inject("validation", 1)
    monkeypatch.delenv("NEDOLM_TEST_FAULT")
    monkeypatch.setenv("NEDOLM_TEST_DELAY", "checkpoint_write=0.2")
    started = time.monotonic()
    maybe_inject("checkpoint_write", 0)
    assert time.monotonic() - started >= 0.2


def test_the_module_entry_installs_its_handlers_before_torch_is_imported(tmp_path: Path) -> None:
    """So a signal in torch's seconds-long import is kept (test_resume signals there)."""
    assert torch_at_stop_installs("nedolm.train", str(tmp_path / "none.yaml")) == [False]
