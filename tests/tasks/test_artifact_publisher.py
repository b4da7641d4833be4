"""The iterations' artifacts are published beside the run (tasks/artifacts.py: BackgroundPublisher): in order, each
in the context of the run that handed it over, a failure a warning, and a stopped run not kept waiting. That the
artifacts of a real run reach the API, linked to their iterations' task runs, is
tests/flows/test_lineage_and_operations.py's."""

from __future__ import annotations

import contextvars
import logging
import threading
import time

import pytest

from redteam_grpo.tasks.artifacts import BackgroundPublisher

RUN = contextvars.ContextVar("run", default=None)


def test_publications_run_in_order_in_another_thread_each_with_the_context_it_was_handed_over_in():
    publisher, seen = BackgroundPublisher(), []

    def publish(number: int) -> None:
        time.sleep(0.01 * (3 - number))  # the first is the slowest: order is kept, not finishing order
        seen.append((number, RUN.get(), threading.current_thread() is threading.main_thread()))

    with publisher.publishing():  # the run's iterations: all published when they end
        for number in range(3):
            RUN.set(f"iteration-{number}")  # as each iteration's task run is the context its artifacts belong to
            publisher.submit(f"the artifacts of iteration {number}", publish, number)
    assert seen == [(n, f"iteration-{n}", False) for n in range(3)]


def test_a_failed_publication_is_a_warning_that_names_it_and_the_next_ones_are_published(caplog):
    publisher, seen = BackgroundPublisher(), []

    def publish(number: int) -> None:
        if number == 1:
            raise RuntimeError("the API answered 503")
        seen.append(number)

    with caplog.at_level(logging.WARNING):
        for number in range(3):
            publisher.submit(f"the artifacts of iteration {number}", publish, number)
        publisher.finish()
    assert seen == [0, 2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["the artifacts of iteration 1 were not published: RuntimeError: the API answered 503"]


def test_a_stopped_run_does_not_wait_for_publications_and_drops_those_not_started():
    publisher, seen, release = BackgroundPublisher(), [], threading.Event()

    def publish(number: int) -> None:
        if number == 0:
            release.wait(30)  # an API that does not answer
        seen.append(number)

    began = time.perf_counter()
    with pytest.raises(KeyboardInterrupt), publisher.publishing():  # the run's iterations, stopped by a Ctrl-C
        publisher.submit("the artifacts of iteration 0", publish, 0)
        publisher.submit("the artifacts of iteration 1", publish, 1)
        raise KeyboardInterrupt
    assert time.perf_counter() - began < 5  # not the 30 s the first one waits
    release.set()
    for _ in range(100):  # the one under way ends on its own; the one not started never runs
        if seen:
            break
        time.sleep(0.05)
    time.sleep(0.1)
    assert seen == [0]
