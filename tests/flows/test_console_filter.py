"""The CLI's filter on Prefect's console handler: Prefect's echo of a stop or a failure stays off the console,
whichever of its loggers says it; anything else gets through."""

from __future__ import annotations

import logging

import pytest

from flows.console import _NoTraceback


def _record(name: str, level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, message, None, None)


@pytest.mark.parametrize("logger", ["prefect.flow_runs", "prefect.task_runs", "prefect.engine"])
@pytest.mark.parametrize(
    "message",
    [
        "Crash detected! Execution was aborted by an interrupt signal.",
        "Crash detected! Execution was aborted by a termination signal.",
        "Finished in state Failed('Flow run encountered an exception.')",
    ],
)
def test_prefect_s_echo_of_a_stop_or_failure_is_dropped_from_any_of_its_run_loggers(logger, message):
    # prefect.engine says it when the stop comes before the engine has its run's logger (a Ctrl-C at a subflow's
    # start): that echo reached the console beside the CLI's own line
    assert not _NoTraceback().filter(_record(logger, logging.ERROR, message))


@pytest.mark.parametrize(
    ("logger", "level", "message"),
    [
        ("prefect.engine", logging.WARNING, "Crash detected! Execution was aborted by an interrupt signal."),
        ("prefect.engine", logging.ERROR, "Engine could not reach the API"),
        ("prefect.flow_runs", logging.ERROR, "the scorer's server answered 500"),
        ("prefect.flow_runs", logging.INFO, "Finished in state Completed()"),
        ("tasks.score", logging.ERROR, "Crash detected! Execution was aborted by an interrupt signal."),
    ],
)
def test_other_records_reach_the_console(logger, level, message):
    assert _NoTraceback().filter(_record(logger, level, message))


@pytest.mark.parametrize("service", ["EventsWorker", "APILogWorker"])
def test_a_services_flush_progress_at_exit_is_dropped(service):
    # a finished command on a busy machine printed "EventsWorker - Still processing items: 3 items remaining..."
    # after its own error line (tests/e2e/test_cli.py::test_a_failure_inside_a_prefect_task_is_the_error_line_alone)
    assert not _NoTraceback().filter(_record(service, logging.WARNING, "Still processing items: 3 items remaining..."))
    assert _NoTraceback().filter(_record(service, logging.WARNING, "Failed to send events"))
