"""How `redteam-grpo run` stops on SIGTERM or SIGINT: within seconds, the run marked `interrupted`, one line.

Prefect's flow engine installs its own SIGTERM handler while a flow runs: it raises `TerminationSignal`, reports
the flow run as crashed (or cancelled, when a worker asked), and then sends the signal again to the handler
that was installed before it, so that the process still ends. Left to Python's default, that second delivery
kills the process on the spot: no message, no exit status of ours, and the ephemeral API server Prefect started
is left running. The handler installed here raises the same exception as Prefect's instead, so the call
unwinds normally: `run_iterations` marks the run `interrupted`, the command prints how to resume and exits 143
(SIGTERM) or 130 (SIGINT), as a shell reports a process ended by that signal, and Prefect's exit hook stops
its server. SIGINT, which Prefect leaves alone, raises KeyboardInterrupt as usual. A signal the process was
started with ignored (`nohup`, a background job) is left ignored (`interrupts.take_over`; Prefect still takes
SIGTERM over while a flow runs).

A terminal's Ctrl-C, or a supervisor that signals the whole process group, stops that API server too, and
Prefect then retries each state report for about a minute. A stop must not wait on an API that was stopped
with it: a thread sees every stop signal as it arrives (Python's wakeup fd, whichever handler then runs), and
if the command has not finished STOP_GRACE_SECONDS later it marks the run `interrupted`, prints the line and
exits with the same status.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from redteam_grpo.storage import interrupts, ownership
from redteam_grpo.storage.rundir import RunDir, command_for

STOP_GRACE_SECONDS = 5.0


def resume_hint(root: Path, signum: int) -> str:
    if not (root / "manifest.json").is_file():
        return (
            f"run {root.name} interrupted by {interrupts.signal_name(signum)} before it started: nothing was "
            "written; run the same command again"
        )
    return (
        f"run {root.name} interrupted by {interrupts.signal_name(signum)}: its completed stages are kept; "
        f"continue it with: redteam-grpo {command_for(root)} --resume {root}"
    )


class StopOnSignal:
    """Turn SIGTERM / SIGINT into an orderly stop of the run in `root`, bounded in time."""

    def __init__(self, root: Path, say: Callable[[str], None], grace_seconds: float = STOP_GRACE_SECONDS):
        self.root = root
        self.say = say
        self.grace_seconds = grace_seconds
        self._raised = False
        self._reported = threading.Event()

    def install(self) -> None:
        """From the main thread, before the run starts; `uninstall` when the command ends."""
        self._previous = interrupts.take_over(self._on_signal)  # an ignored signal stays ignored
        receiver, sender = socket.socketpair()
        sender.setblocking(False)
        self._previous_wakeup = signal.set_wakeup_fd(sender.fileno(), warn_on_full_buffer=False)
        self._wakeup = (receiver, sender)
        threading.Thread(target=self._watch, args=(receiver,), name="stop-watch", daemon=True).start()

    def uninstall(self) -> None:
        """Put back the handlers and the wake-up descriptor found at `install`, and end the watcher (a command
        run inside a longer-lived process, such as a test, must leave signals as it found them)."""
        interrupts.give_back(self._previous)
        signal.set_wakeup_fd(self._previous_wakeup)
        self._wakeup[1].close()  # the watcher's recv returns b"" and it ends

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self._raised:
            # Prefect's second delivery of a stop it has handled, or an impatient repeat: the stop is under way
            # and bounded in time; raising again would only cut the manifest update short.
            return
        self._raised = True
        from redteam_grpo.flows.runner import stop_exception

        raise stop_exception(signum)

    def report(self, signum: int) -> int:
        """Print the one line and return the exit status, once the stop has unwound to the command."""
        self._reported.set()
        self.say(resume_hint(self.root, signum))
        return interrupts.EXIT_STATUS[signum]

    def _watch(self, receiver: socket.socket) -> None:
        # The receiver stays open until `uninstall`: a signal repeated during the stop (Prefect re-delivers
        # SIGTERM) is written to the wake-up descriptor too, and a closed peer made Python print a BrokenPipeError.
        with receiver:
            signum, deadline = None, 0.0
            while True:
                waiting = signum is not None and not self._reported.is_set()
                receiver.settimeout(0.1 if waiting else None)
                try:
                    data: bytes | None = receiver.recv(64)
                except TimeoutError:
                    data = None
                if data == b"":  # uninstalled: the command has ended
                    return
                if signum is None and data:
                    signum = next((b for b in data if b in interrupts.STOP_SIGNALS), None)
                    deadline = time.monotonic() + self.grace_seconds
                if waiting and time.monotonic() >= deadline:
                    self._give_up(signum)

    def _give_up(self, signum: int) -> None:
        """The stop did not unwind to the command within the grace time: mark the run and exit from here, whatever
        marking or saying it raises (an exception here would end this thread and leave the process running)."""
        try:
            for root in ownership.owned_roots():  # its owner is this process, stuck: nothing else writes the run
                RunDir(root).set_status("interrupted", interrupted_by=interrupts.signal_name(signum))
            self.say(resume_hint(self.root, signum))
            sys.stderr.flush()
        finally:
            os._exit(interrupts.EXIT_STATUS[signum])
