"""Stopping on SIGTERM / SIGINT without a stage file and its manifest entry disagreeing.

A stop signal becomes an exception in the main thread wherever it happens to be (Prefect's SIGTERM handler
raises `TerminationSignal`, Python's SIGINT handler `KeyboardInterrupt`). Files are written atomically, so an
exception anywhere leaves either the old file or the new one, whole; `recording()` closes the one gap left: it
holds a signal back while a stage's last file is renamed into place and recorded, so a stage's output is in
place exactly when the manifest says it is completed. The signal is delivered again, to whatever handler was
installed, as soon as the block ends (milliseconds).

An ignored signal stays ignored: a process started with SIGINT or SIGTERM ignored (`nohup`, a shell's background
job, a service manager) was asked not to stop on it, so no handler of ours (`take_over`) replaces SIG_IGN. Prefect's
flow engine does, for SIGTERM while a flow runs (prefect/utilities/engine: `capture_sigterm`): SIGTERM still stops.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The exit status of a process stopped by a signal, as a shell reports it (128 + the signal's number).
EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def take_over(handler: Callable[[int, FrameType | None], Any]) -> dict[int, Any]:
    """Install `handler` for SIGTERM and SIGINT, from the main thread, except where a signal is ignored: SIG_IGN
    stays. Returns the handlers it replaced, for `give_back`."""
    return {
        signum: signal.signal(signum, handler)
        for signum in STOP_SIGNALS
        if signal.getsignal(signum) is not signal.SIG_IGN
    }


def give_back(previous: dict[int, Any]) -> None:
    """Put back the handlers `take_over` replaced."""
    for signum, handler in previous.items():
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # None: installed outside Python


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Hold SIGTERM and SIGINT back for the duration of the block, then deliver any that came.

    Only the main thread receives signals in Python, so elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = take_over(lambda n, _frame: held.append(n))
    try:
        yield
    finally:
        give_back(previous)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)
