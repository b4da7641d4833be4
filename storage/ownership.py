"""One owner per run directory: the process that runs its stages holds an exclusive lock on `RUN/owner.lock`.

Two processes running stages of one run interleave their writes: both train from the same checkpoint and
rename their files over each other's, so a checkpoint can end up with one process's optimizer and the other's
manifest. The lock is `flock` on an open file: the OS releases it when the owner exits, however it exits, so
there is nothing stale to break. The file names the owner (pid, host, start time) for the refusal message;
the owner empties it when it lets go, so a file that still names someone was left by a process that died
while it owned the run.

A run directory on object storage (a URL, storage/location.py) has no lock to take: there the owner record alone
says who owns the run, and it is created only where none exists (a conditional write, fsspec's mode "xb": S3's
`If-None-Match`, GCS's generation match, Azure's no-overwrite, a local file's O_EXCL), so that of two processes
that start at the same instant exactly one owns the run. The owner deletes the record when it lets go. A record
that names a process is honoured until then; one left by a process that died on this host is taken over, one from
another host must be removed by hand (the refusal says how). A store whose driver cannot create a file only where
none exists falls back to check-then-write, with a warning that names the race.

Readers (inspect, infer) take no lock: every file they read was renamed into place whole. What writes the files
derived from a run (`evaluate`'s RUN/eval, `export`'s RUN/export, `report`'s RUN/report.html) holds a second lock,
`RUN/derived.lock` (DERIVED), by the same rules: one such writer at a time, while the run's owner may go on
training (it never writes those files). The descriptor is not inherited by child processes (Python opens files
non-inheritable), so a subprocess started during a run, such as Prefect's ephemeral API server, never holds the lock
for its parent.
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
from redteam_grpo.storage.rundir import DERIVED_FILE, OWNER_FILE, RunDir, RunDirError, command_for

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunLock:
    """One of a run's locks: its file, and what its holder does (for the refusal)."""

    file: str
    holds: str
    resumable: bool  # the refusal ends with the command that continues the run

    def way_out(self, root: Path) -> str:
        if self.resumable:
            return f"continue with: redteam-grpo {command_for(root)} --resume {root}"
        return "run the command again"


STAGES = RunLock(OWNER_FILE, "run its stages", resumable=True)
DERIVED = RunLock(DERIVED_FILE, "write its evaluations, exports and reports", resumable=False)

# The locks this process holds now, so that a stop that cannot wait for the normal unwinding (cli/signals.py) can
# still mark the runs it owns.
_OWNED: dict[tuple[Path, str], RunOwner] = {}


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
    lock: RunLock = STAGES

    def release(self) -> None:
        """Empty the file (an empty file means: let go cleanly), then unlock; on object storage, delete the record
        (the next owner creates its own, only where none exists)."""
        _OWNED.pop((self.root, self.lock.file), None)
        if self._fd < 0:
            if _recorded_owner(self.root, self.lock) == self.owner:  # never another's record
                (self.root / self.lock.file).unlink(missing_ok=True)
            return
        try:
            os.ftruncate(self._fd, 0)
        finally:
            os.close(self._fd)  # closing the last descriptor releases the flock


def _open_lock(root: Path, lock: RunLock, flags: int = os.O_RDWR | os.O_CREAT) -> int:
    """The lock's file, opened without following a link: one planted there names the damage instead."""
    try:
        return os.open(root / lock.file, flags | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise RunDirError(
            f"{root / lock.file} is a symbolic link, not the run's lock file: someone else may have planted it. "
            f"Remove the link (its target is left alone), then try again"
        ) from None


def _read_owner(fd: int) -> Owner | None:
    os.lseek(fd, 0, os.SEEK_SET)
    return Owner.parse(os.read(fd, 4096).decode(errors="replace"))


def _lock_or_refuse(fd: int, root: Path, lock: RunLock) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = _read_owner(fd)
        os.close(fd)
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        who = holder.describe() if holder else "another process (it has not written its name yet)"
        raise RunOwnedElsewhere(
            f"run {root.name} is owned by {who}: only one process may {lock.holds}. Wait for it to end, or "
            f"stop it (kill -TERM {holder.pid if holder else '<pid>'}: it lets go), then {lock.way_out(root)}"
        ) from None


def _create_record(root: Path, lock: RunLock, owner: Owner, previous: Owner | None) -> None:
    """Object storage: write the owner record only where none exists, or raise RunOwnedElsewhere naming whoever
    created it first. A record left empty (let go by an older version) or by `previous` (dead on this host) is
    deleted first."""
    path, record = root / lock.file, json.dumps(owner.__dict__) + "\n"
    with contextlib.suppress(FileNotFoundError):
        left = path.read_text()
        if not left.strip() or (previous is not None and Owner.parse(left) == previous):  # never a live owner's
            path.unlink(missing_ok=True)
    try:
        with path.open("xb") as handle:
            handle.write(record.encode())
    except FileExistsError:
        holder = _recorded_owner(root, lock)
        who = holder.describe() if holder else "another process (it has not written its name yet)"
        raise RunOwnedElsewhere(
            f"run {root.name} is owned by {who}, which created {path} a moment before this process: only one "
            f"process may {lock.holds}. Wait for it to end, then {lock.way_out(root)}"
        ) from None
    except (NotImplementedError, ValueError) as exc:  # a driver without mode "xb"
        _log.warning(
            "the store of %s cannot create a file only where none exists (%s): the owner record is checked, then "
            "written, so two processes that start within a moment of each other could both run this run's stages; "
            "start one at a time",
            root,
            exc,
        )
        write_atomic(path, lambda tmp: tmp.write_text(record))


def _recorded_owner(root: Path, lock: RunLock = STAGES) -> Owner | None:
    """The owner a run directory on object storage records (None: nobody, or a record that let go)."""
    try:
        return Owner.parse((root / lock.file).read_text())
    except FileNotFoundError:
        return None


def _refuse_if_recorded(root: Path, lock: RunLock = STAGES) -> Owner | None:
    """Object storage: raise RunOwnedElsewhere if the record names a process that may still run; else return the
    previous owner, if the record names one that died on this host."""
    holder = _recorded_owner(root, lock)
    if holder is None or holder.is_dead_here():
        return holder
    raise RunOwnedElsewhere(
        f"run {root.name} is owned by {holder.describe()} ({root / lock.file} names it; a run directory on object "
        f"storage has no lock, only this record): only one process may {lock.holds}. Wait for it to end, or stop "
        f"it (kill -TERM {holder.pid} on {holder.host}: it lets go). If that process no longer runs, delete "
        f"{root / lock.file}, then {lock.way_out(root)}"
    )


def refuse_if_owned(root: str | Path) -> None:
    """Raise RunOwnedElsewhere if a process owns `root` now; takes nothing (a check before slow start-up)."""
    root = location(root)
    if is_remote(root):
        _refuse_if_recorded(root)
        return
    try:
        fd = _open_lock(root, STAGES, os.O_RDONLY)
    except FileNotFoundError:
        return
    _lock_or_refuse(fd, root, STAGES)
    os.close(fd)


def live_owner(root: str | Path) -> Owner | None:
    """The process that owns `root` now, or None when none does (a local lock nobody holds, or an object-storage
    record that is empty or names a process that died on this host). Takes nothing."""
    root = location(root)
    if is_remote(root):
        holder = _recorded_owner(root)
        return None if holder is None or holder.is_dead_here() else holder
    try:
        fd = _open_lock(root, STAGES, os.O_RDONLY)
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
    if run.identity_and_status().get("status") != "running" or live_owner(run.root) is not None:
        return None
    return (
        "its manifest says running, but no process owns it: the process that ran it ended without recording a stop "
        f"(killed, out of memory, or its machine lost). Nothing recorded is lost; continue with: redteam-grpo "
        f"{command_for(run.root)} --resume {run.root}"
    )


def acquire(root: str | Path, lock: RunLock = STAGES) -> RunOwner:
    """Hold `lock` of `root` (which must exist) or raise RunOwnedElsewhere at once, naming the holder and the way
    out."""
    root = location(root)
    if is_remote(root):  # no lock: the record alone
        previous, fd = _refuse_if_recorded(root, lock), -1
    else:
        # O_NOFOLLOW: a symlink planted as the lock file is refused, never followed and its target truncated
        fd = _open_lock(root, lock)
        _lock_or_refuse(fd, root, lock)
        previous = _read_owner(fd)
    if previous is not None:
        state = "is no longer running" if previous.is_dead_here() else "ended without letting go"
        _log.warning("taking over run %s from %s, which %s", root.name, previous.describe(), state)
    owner = Owner.this_process()
    if fd < 0:
        _create_record(root, lock, owner, previous)
    else:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(owner.__dict__) + "\n").encode(), 0)
    held = RunOwner(root, owner, fd, lock)
    _OWNED[(root, lock.file)] = held
    return held


@contextlib.contextmanager
def owning(root: Path, lock: RunLock = STAGES) -> Iterator[RunOwner]:
    """Hold `lock` of the run directory `root` for the duration of the block."""
    held = acquire(root, lock)
    try:
        yield held
    finally:
        held.release()


def owned_roots() -> list[Path]:
    """The run directories whose stages this process owns now."""
    return [root for root, file in _OWNED if file == STAGES.file]
