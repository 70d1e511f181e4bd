"""Real signals to this process set the stop request; the fault hooks parse strictly."""

from __future__ import annotations

import os
import signal
import time

import pytest

from nedolm.train.faults import InjectedFault, maybe_inject
from nedolm.train.signals import StopRequest


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_sets_the_stop_request(signum: int) -> None:
    stop = StopRequest().install()
    assert not stop.requested and stop.describe() == "requested by another rank"
    os.kill(os.getpid(), signum)
    time.sleep(0.01)  # CPython runs the handler at the next bytecode boundary
    assert stop.requested and stop.describe() == signal.Signals(signum).name
    stop.request("max_hours")  # the first reason is kept
    assert stop.describe() == signal.Signals(signum).name


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
