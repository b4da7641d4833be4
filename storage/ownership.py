"""One owner per run directory: the process that runs its stages holds an exclusive lock on `RUN/owner.lock`.

Two processes running stages of one run interleave their writes: both train from the same checkpoint and
rename their files over each other's, so a checkpoint can end up with one process's optimizer and the other's
manifest. The lock is `flock` on an open file: the OS releases it when the owner exits, however it exits, so
there is nothing stale to break. The file names the owner (pid, host, start time) for the refusal message;
the owner empties it when it lets go, so a file that still names someone was left by a process that died
while it owned the run.

A run directory on object storage (a URL, storage/location.py) has no lock to take: there the owner record alone
says who owns the run. A record that names a process is honoured until that process lets go (it empties the record);
one left by a process that died on this host is taken over, one from another host must be removed by hand (the
refusal says how). Two processes that start at the same instant are not kept apart by a record: scheduled jobs of
one run directory on object storage are placed one at a time by Prefect (a deployment's concurrency_limit=1).

Readers (inspect, report, export, infer) do not take the lock: every file they read was renamed into place
whole. The descriptor is not inherited by child processes (Python opens files non-inheritable), so a
subprocess started during a run, such as Prefect's ephemeral API server, never holds the lock for its parent.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from redteam_grpo.storage.atomic import write_atomic
from redteam_grpo.storage.location import is_remote, location
from redteam_grpo.storage.rundir import OWNER_FILE, RunDir, RunDirError, command_for

_log = logging.getLogger(__name__)
# The runs this process owns now, so that a stop that cannot wait for the normal unwinding (cli/signals.py) can
# still mark them.
_OWNED: dict[Path, RunOwner] = {}


class RunOwnedElsewhere(RunDirError):
    """Another process runs the stages of this run directory; the message names it and the way out."""


@dataclass(frozen=True)
class Owner:
    pid: int
    host: str
    started_at: str

    @classmethod
    def this_process(cls) -> Owner:
        return cls(os.getpid(), socket.gethostname(), dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))

    @classmethod
    def parse(cls, text: str) -> Owner | None:
        try:
            data = json.loads(text)
            return cls(int(data["pid"]), str(data["host"]), str(data["started_at"]))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started_at}"

    def is_dead_here(self) -> bool:
        """True if this owner ran on this host and no process has its pid any more."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # a process of another user has that pid now
            return False
        return False


@dataclass
class RunOwner:
    root: Path
    owner: Owner
    _fd: int  # -1: a run directory on object storage (no lock, the record only)

    def release(self) -> None:
        """Empty the file (an empty file means: let go cleanly), then unlock."""
        _OWNED.pop(self.root, None)
        if self._fd < 0:
            _write_record(self.root, "")
            return
        try:
            os.ftruncate(self._fd, 0)
        finally:
            os.close(self._fd)  # closing the last descriptor releases the flock


def _open_lock(root: Path, flags: int = os.O_RDWR | os.O_CREAT) -> int:
    """The run's owner.lock, opened without following a link: one planted there names the damage instead."""
    try:
        return os.open(root / OWNER_FILE, flags | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise RunDirError(
            f"{root / OWNER_FILE} is a symbolic link, not the run's lock file: someone else may have planted it. "
            f"Remove the link (its target is left alone), then try again"
        ) from None


def _read_owner(fd: int) -> Owner | None:
    os.lseek(fd, 0, os.SEEK_SET)
    return Owner.parse(os.read(fd, 4096).decode(errors="replace"))


def _lock_or_refuse(fd: int, root: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _read_owner(fd)
        os.close(fd)
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        who = holder.describe() if holder else "another process (it has not written its name yet)"
        raise RunOwnedElsewhere(
            f"run {root.name} is owned by {who}: only one process may run its stages. Wait for it to end, or "
            f"stop it (kill -TERM {holder.pid if holder else '<pid>'}: it marks the run interrupted), then "
            f"continue with: redteam-grpo {command_for(root)} --resume {root}"
        ) from None


def _write_record(root: Path, text: str) -> None:
    write_atomic(root / OWNER_FILE, lambda tmp: tmp.write_text(text))


def _recorded_owner(root: Path) -> Owner | None:
    """The owner a run directory on object storage records (None: nobody, or a record that let go)."""
    try:
        return Owner.parse((root / OWNER_FILE).read_text())
    except FileNotFoundError:
        return None


def _refuse_if_recorded(root: Path) -> Owner | None:
    """Object storage: raise RunOwnedElsewhere if the record names a process that may still run; else return the
    previous owner, if the record names one that died on this host."""
    holder = _recorded_owner(root)
    if holder is None or holder.is_dead_here():
        return holder
    raise RunOwnedElsewhere(
        f"run {root.name} is owned by {holder.describe()} ({root / OWNER_FILE} names it; a run directory on object "
        f"storage has no lock, only this record): only one process may run its stages. Wait for it to end, or stop "
        f"it (kill -TERM {holder.pid} on {holder.host}: it lets go). If that process no longer runs, delete "
        f"{root / OWNER_FILE}, then continue with: redteam-grpo {command_for(root)} --resume {root}"
    )


def refuse_if_owned(root: str | Path) -> None:
    """Raise RunOwnedElsewhere if a process owns `root` now; takes nothing (a check before slow start-up)."""
    root = location(root)
    if is_remote(root):
        _refuse_if_recorded(root)
        return
    try:
        fd = _open_lock(root, os.O_RDONLY)
    except FileNotFoundError:
        return
    _lock_or_refuse(fd, root)
    os.close(fd)


def live_owner(root: str | Path) -> Owner | None:
    """The process that owns `root` now, or None when none does (a local lock nobody holds, or an object-storage
    record that is empty or names a process that died on this host). Takes nothing."""
    root = location(root)
    if is_remote(root):
        holder = _recorded_owner(root)
        return None if holder is None or holder.is_dead_here() else holder
    try:
        fd = _open_lock(root, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            return _read_owner(fd) or Owner(-1, "?", "?")  # held; its name not written yet
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def stopped_unexpectedly(run: RunDir) -> str | None:
    """When the manifest says running but no process owns the run: what happened and the command that continues it
    (its process was killed, by kill -9, the out-of-memory killer or a lost machine, before it could record a stop).
    None otherwise."""
    if run.manifest().get("status") != "running" or live_owner(run.root) is not None:
        return None
    return (
        "its manifest says running, but no process owns it: the process that ran it ended without recording a stop "
        f"(killed, out of memory, or its machine lost). Nothing recorded is lost; continue with: redteam-grpo "
        f"{command_for(run.root)} --resume {run.root}"
    )


def acquire(root: str | Path) -> RunOwner:
    """Own `root` (which must exist) or raise RunOwnedElsewhere at once, naming the owner and the way out."""
    root = location(root)
    if is_remote(root):  # no lock: the record alone
        previous, fd = _refuse_if_recorded(root), -1
    else:
        # O_NOFOLLOW: a symlink planted as owner.lock is refused, never followed and its target truncated
        fd = _open_lock(root)
        _lock_or_refuse(fd, root)
        previous = _read_owner(fd)
    if previous is not None:
        state = "is no longer running" if previous.is_dead_here() else "ended without letting go"
        _log.warning("taking over run %s from %s, which %s", root.name, previous.describe(), state)
    owner = Owner.this_process()
    record = json.dumps(owner.__dict__) + "\n"
    if fd < 0:
        _write_record(root, record)
    else:
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
    held = RunOwner(root, owner, fd)
    _OWNED[root] = held
    return held


@contextlib.contextmanager
def owning(root: Path) -> Iterator[RunOwner]:
    """Hold the run directory `root` for the duration of the block."""
    held = acquire(root)
    try:
        yield held
    finally:
        held.release()


def owned_roots() -> list[Path]:
    """The run directories this process owns now."""
    return list(_OWNED)
