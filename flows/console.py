"""Prefect's console output for the CLI: a failed flow or task run's traceback, and its "Finished in state Failed"
line, stay off the console, because the CLI reports the cause itself as one `error:` line (with `--verbose`, or in
the Prefect API, the traceback is there)."""

from __future__ import annotations

import logging

# Prefect's line for each flow and task run a stop signal unwound (prefect/states.py: exception_to_crashed_state):
# the CLI says once that the run was interrupted, by which signal, and how to resume it (cli/signals.py).
_STOPPED = (
    "Crash detected! Execution was aborted by an interrupt signal.",
    "Crash detected! Execution was aborted by a termination signal.",
)

# a run stopped before its engine has its run logger says it through "prefect.engine"
_ECHOING_LOGGERS = ("prefect.task_runs", "prefect.flow_runs", "prefect.engine")
# Prefect's background services (prefect/_internal/concurrency/services.py: QueueService, each logging under its class
# name) report every 4 s of their flush at exit that items remain: on a busy machine a command that has finished its
# work and printed its result then adds "EventsWorker - Still processing items: 3 items remaining...". The items are
# the run's events and API logs, still delivered; the line says nothing about the run.
_DRAINING = "Still processing items:"


class _NoTraceback(logging.Filter):
    """Drops the records that carry a traceback, and Prefect's echo of a run's failure ("Finished in state
    Failed(...)") or of its stop by a signal ("Crash detected! ..."): the CLI's line says the same once, with the
    way out. Drops too its services' progress of their flush at exit (`_DRAINING`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is not None:
            return False
        echo = record.levelno >= logging.ERROR and record.name in _ECHOING_LOGGERS
        if echo and str(record.msg).startswith(("Finished in state", *_STOPPED)):
            return False
        return not (record.levelno == logging.WARNING and str(record.msg).startswith(_DRAINING))


def keep_tracebacks_off_console() -> None:
    """Set up Prefect's logging now and filter its console handler. Call after `quiet_libraries(False)`."""
    from prefect.logging.configuration import setup_logging
    from prefect.logging.handlers import PrefectConsoleHandler

    setup_logging()
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in logging.Logger.manager.loggerDict)]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler) and not any(
                isinstance(f, _NoTraceback) for f in handler.filters
            ):
                handler.addFilter(_NoTraceback())
