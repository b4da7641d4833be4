"""The logger of a stage: Prefect's run logger inside a flow or task run (so the Prefect API keeps every line),
a plain logger when a stage is called directly (tests, `task.fn()`)."""

from __future__ import annotations

import logging


def stage_logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        from prefect import get_run_logger

        return get_run_logger()
    except Exception:  # MissingContextError outside a run
        return logging.getLogger("redteam_grpo")
