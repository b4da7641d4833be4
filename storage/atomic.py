"""Writes that are all-or-nothing: a temporary name in the same folder, fsync, then rename.

A reader never sees a half-written file: either the old content, or the new, whole. Temporary files start
with `.tmp-` and are never read; a crash leaves at most such a file behind. On a store reached through fsspec (a
run directory at a URL, storage/location.py) the file is written locally, uploaded whole under the temporary name
and moved into place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from redteam_grpo.storage.location import is_remote, move, upload

TMP_PREFIX = ".tmp-"


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces `path`, on error it is removed."""
    if is_remote(path):
        with _remote_atomic_path(path) as tmp:
            yield tmp
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _create_temporary(path)
    try:
        yield tmp
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def temporary_name(path: Path) -> Path:
    """A name beside `path` that no one can guess ahead (`.tmp-<pid>-<random>-<name>`): what is planted under a
    predictable name is never written through."""
    return path.with_name(f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}-{path.name}")


def temporary_folder(path: Path) -> Path:
    """A new, empty folder beside the folder `path` under an unpredictable name, made here (mkdir fails on anything
    already there, a link included)."""
    return _create_fresh(path, lambda tmp: tmp.mkdir(mode=0o755), "folder")


def _create_temporary(path: Path) -> Path:
    """A new, empty file beside `path` under an unpredictable name, created here (O_EXCL) and never through a link
    (O_NOFOLLOW): a file or symlink planted under a name that could be guessed is never written through."""
    return _create_fresh(
        path, lambda tmp: os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)), "file"
    )


def _create_fresh(path: Path, create: Callable[[Path], object], what: str) -> Path:
    """`create` at a temporary name beside `path` that nothing holds yet (a few tries: a name is random)."""
    for _ in range(8):
        tmp = temporary_name(path)
        try:
            create(tmp)
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name beside the {what}", str(path))


@contextlib.contextmanager
def _remote_atomic_path(path: Path) -> Iterator[Path]:
    """A local temporary file; on success uploaded whole under a temporary name beside `path`, then moved over it."""
    with tempfile.TemporaryDirectory(prefix="redteam-grpo-") as folder:
        local = Path(folder) / path.name
        yield local
        remote_tmp = temporary_name(path)
        try:
            upload(local, remote_tmp)
            move(remote_tmp, path)
        finally:
            if remote_tmp.exists():
                remote_tmp.unlink()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# How libraries that do their own I/O (safetensors, in Rust) word a full disk in the errors they raise.
_DISK_FULL_WORDS = ("No space left on device", "StorageFull", "Disk quota exceeded")


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """`write(tmp)`, then `tmp` renamed to `path`. A full disk, however the writing library words it, is an
    OSError(ENOSPC) naming `path`, so that it reads as one (cli/errors.py) and not as a damaged file."""
    with atomic_path(path) as tmp:
        try:
            write(tmp)
        except OSError:
            raise
        except Exception as exc:
            if any(words in str(exc) for words in _DISK_FULL_WORDS):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from exc
            raise


def write_json_atomic(path: Path, data: Any) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n"))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
