"""The temporary Prefect API server dies with the CLI, however the CLI dies.

Without PREFECT_API_URL, Prefect starts a temporary API server as a child process (uvicorn running
`prefect.server.api.server:create_app`) and stops it at exit. A CLI killed with SIGKILL (kill -9, the out-of-memory
killer) runs no exit handler, and the server lived on as an orphan holding its port and database. A watcher process
(`watch`) is started beside the CLI: it notes the CLI's API server children while the CLI lives, and when the CLI is
gone it stops those that still run (SIGTERM, then SIGKILL). It needs /proc (Linux); elsewhere nothing is started.

A process is named by (pid, start time), so a pid reused after the server ended is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SERVER_MARK = b"prefect.server.api.server:create_app"  # in the temporary server's command line
POLL_SECONDS = 0.5
GRACE_SECONDS = 5.0


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _servers_of(parent: int) -> set[tuple[int, str]]:
    """The temporary Prefect API servers whose parent is `parent`, as (pid, start time)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != parent:
                continue
            if SERVER_MARK not in (entry / "cmdline").read_bytes():
                continue
        except (OSError, ValueError, IndexError):
            continue
        started = stat.rsplit(")", 1)[1].split()[19]
        found.add((int(entry.name), started))
    return found


def _alive(process: tuple[int, str]) -> bool:
    return _start_time(process[0]) == process[1]


def _signal(process: tuple[int, str], signum: int) -> None:
    if _alive(process):
        with contextlib.suppress(ProcessLookupError):  # it ended between the check and the signal
            os.kill(process[0], signum)


def _stop(servers: set[tuple[int, str]]) -> None:
    for server in servers:
        _signal(server, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    while any(map(_alive, servers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for server in servers:
        _signal(server, signal.SIGKILL)


def watch(parent: int) -> None:
    """Note `parent`'s API servers while it lives; once it is gone, stop those still running."""
    me = (parent, _start_time(parent))
    servers: set[tuple[int, str]] = set()
    while _alive(me):
        servers |= _servers_of(parent)
        time.sleep(POLL_SECONDS)
    _stop(servers)


def stop_api_server_with_this_process() -> None:
    """Start the watcher for this process, when Prefect would start a temporary API server here (no
    PREFECT_API_URL) and /proc is there to watch it with."""
    if os.environ.get("PREFECT_API_URL") or not Path("/proc/self/stat").exists():
        return
    subprocess.Popen(
        [sys.executable, "-m", "redteam_grpo.cli.reaper", str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the CLI's process group must not stop the watcher first
    )


if __name__ == "__main__":
    watch(int(sys.argv[1]))
