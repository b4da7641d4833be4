"""What the console shows while work runs.

By default: the CLI's own progress bar and tables, and warnings and errors. With `--verbose` (or
`logging.level=DEBUG`) also Prefect's INFO lines for every flow and task run, transformers' weight-loading
bars and its advisory messages, and the deprecation warnings libraries address to their developers.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Annotated

import typer

# Prefect applies PREFECT_LOGGING_<path>_<key> variables as overrides of its logging.yml when it sets up
# logging (at import). Its console and API handlers are separate: raising the console handler's level keeps
# every record flowing to the Prefect API (UI, `prefect flow-run logs`).
PREFECT_CONSOLE_LEVEL = "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"
# The temporary API server Prefect starts for a run writes to the CLI's console (its stderr is ours): at its shutdown
# an event flush cut short logs CancelledError tracebacks that say nothing about the run. It reads this variable from
# the environment it inherits; its records go nowhere else, and a server that fails shows as the client's error.
PREFECT_SERVER_LEVEL = "PREFECT_SERVER_LOGGING_LEVEL"

VerboseOption = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Also show Prefect's flow and task run lines, model-loading bars and library warnings "
        "(as does logging.level=DEBUG).",
    ),
]


def quiet_libraries(verbose: bool) -> None:
    """Keep library chatter off the console unless `verbose`. Call before prefect is imported."""
    if verbose:
        # Prefect's own console level, also where a quiet command earlier in this process (or its parent's
        # environment) left an override behind; the libraries are left at their defaults.
        os.environ.pop(PREFECT_CONSOLE_LEVEL, None)
        os.environ.pop(PREFECT_SERVER_LEVEL, None)
        return
    os.environ.setdefault(PREFECT_CONSOLE_LEVEL, "WARNING")  # a level the user set explicitly wins
    os.environ.setdefault(PREFECT_SERVER_LEVEL, "CRITICAL")
    for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    # A handler that cannot deliver a record (Prefect's API log worker once a Ctrl-C has stopped the temporary API
    # server too) writes "--- Error logging to API ---" to stderr only while this is set; --verbose keeps it.
    logging.raiseExceptions = False

    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()
    download_bars = not are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()  # switches off the hub's bars too
    if download_bars:
        # A first download of a real model takes minutes; without its bar it looks like a hang.
        enable_progress_bars()
