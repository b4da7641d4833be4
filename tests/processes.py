"""Stop signals in tests, whatever the test runner inherited.

A runner started in the background (`pytest &` from a script, `nohup`, a scheduler) has SIGINT ignored, and its
children inherit SIG_IGN, which the code keeps (bug class inherited-sig-ign-overridden): a child that a test stops
with a signal is started with that signal at its default action (`preexec_fn=default_stop_signals`), and a test of
what a handler does in this process installs the handler it needs (`handlers`) rather than assuming Python's."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

from redteam_grpo.storage.interrupts import STOP_SIGNALS, give_back


def default_stop_signals() -> None:
    """`preexec_fn` of a child a test stops with SIGINT or SIGTERM: both at their default action, as from a
    terminal (a Python child then gets its usual KeyboardInterrupt handler)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


def ignoring_sigint() -> None:
    """`preexec_fn` of a child started as `nohup` or a shell's background job starts it: SIGINT ignored."""
    default_stop_signals()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def dispositions() -> dict[int, Any]:
    """This process's handler of each stop signal."""
    return {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}


@contextlib.contextmanager
def handlers(installed: dict[int, Any]) -> Iterator[None]:
    """These handlers in this process (from the main thread) for the block; the previous ones put back after."""
    previous = {signum: signal.signal(signum, handler) for signum, handler in installed.items()}
    try:
        yield
    finally:
        give_back(previous)


def hold_a_run_lock(root, lock: str = "STAGES"):
    """A child process that holds `lock` (storage/ownership.py: "STAGES" or "DERIVED") of the run at `root` until it
    is killed, as another `run` or `evaluate` would; returned once it holds it."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, time; from redteam_grpo.storage import ownership; "
        f"ownership.acquire(sys.argv[1], ownership.{lock}); print('held', flush=True); time.sleep(120)"
    )
    cwd = Path(__file__).resolve().parents[1]
    child = subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE, text=True, cwd=cwd)
    assert child.stdout.readline().strip() == "held"
    return child
