"""The stop handler of `redteam-grpo run`: a signal repeated during the stop (Prefect re-delivers SIGTERM to the
handler it replaced) finds its wake-up descriptor open, so Python prints no `BrokenPipeError` from it; a signal the
process was started with ignored stays ignored."""

import os
import signal
import sys
import time

import pytest

from redteam_grpo.cli.signals import StopOnSignal
from redteam_grpo.flows.runner import STOP_EXCEPTIONS
from redteam_grpo.storage.interrupts import STOP_SIGNALS
from tests.processes import dispositions, handlers


def test_a_repeated_stop_signal_writes_to_an_open_wakeup_descriptor(tmp_path, monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: unraisable.append(info))
    said = []
    stop = StopOnSignal(tmp_path, said.append, grace_seconds=30)
    with handlers({signal.SIGTERM: signal.SIG_DFL}):  # as a process started from a terminal has it
        stop.install()
        try:
            with pytest.raises(STOP_EXCEPTIONS):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)  # the handler raises here
            time.sleep(0.3)  # the watcher has read the first signal's wake-up byte
            for _ in range(3):  # the stop is under way: repeats are ignored by the handler
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)
            assert stop.report(signal.SIGTERM) == 143
        finally:
            stop.uninstall()
    time.sleep(0.1)
    assert [str(u.exc_value) for u in unraisable] == []
    assert len(said) == 1 and "interrupted by SIGTERM" in said[0]


def test_a_stop_signal_the_process_was_started_with_ignored_stays_ignored(tmp_path):
    # bug class inherited-sig-ign-overridden: `nohup`, a shell's background job or a service manager starts a run
    # with SIGINT (or SIGTERM) ignored; the run must not stop on it
    said = []
    stop = StopOnSignal(tmp_path, said.append, grace_seconds=0.2)
    ignored = {signum: signal.SIG_IGN for signum in STOP_SIGNALS}
    with handlers(ignored):
        stop.install()
        try:
            assert dispositions() == ignored
            for signum in STOP_SIGNALS:
                os.kill(os.getpid(), signum)
            time.sleep(0.5)  # past the grace time: the watcher has no stop to give up on
        finally:
            stop.uninstall()
        assert dispositions() == ignored
    assert said == []
