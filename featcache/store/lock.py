"""One writer per store: an advisory lock held from before a run touches its output until the end.

An exclusive POSIX record lock (``fcntl.lockf``; NFS v4 honours it) on ``<store>.lock``,
which records the holder for a second run to name; the kernel drops it when its process
dies. The lock creates a missing output folder, and a failed or refused run removes the
folders it created and left empty.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from featcache.errors import ConfigError
from featcache.util.files import prepare_output_folder, remove_empty_folders

# A probe (`featcache info`) holds the lock for an instant; a writer retries that long.
_ATTEMPTS, _PAUSE = 5, 0.05

# The stores this process holds: POSIX locks belong to the process (its second lock would
# succeed, closing any descriptor drops it), so nesting and probing are decided here.
_held: dict[Path, Holder] = {}
_guard = threading.Lock()


class StoreBusyError(ConfigError):
    """Another process is writing the store."""


@dataclass(frozen=True)
class Holder:
    """The process that holds a store's lock."""

    pid: int
    host: str
    started: str  # ISO 8601, UTC
    output: str

    def describe(self) -> str:
        """``pid 1234 on host node7, started 2026-11-23 13:55:02 UTC``."""
        when = self.started.replace("T", " ").split(".")[0].removesuffix("+00:00")
        return f"pid {self.pid} on host {self.host}, started {when} UTC"


def lock_path(path: str | os.PathLike) -> Path:
    """The lock file of the store at ``path``."""
    path = Path(path)
    return path.with_name(path.name + ".lock")


@contextlib.contextmanager
def writer_lock(path: str | os.PathLike) -> Iterator[Holder]:
    """Hold the store at ``path`` for writing for the ``with`` block; yields the record.
    Nested use in one process shares the one lock; the lock file is removed on release.

    Raises:
        StoreBusyError: another process holds it (one line naming that process).
        ConfigError: the output folder cannot be created or written.
    """
    key = Path(os.path.abspath(path))
    with _guard:
        outer = _held.get(key)
    if outer is not None:  # the outermost hold releases
        yield outer
        return
    created = prepare_output_folder(key.parent)
    try:
        fd, record = _acquire(key)
    except BaseException:
        remove_empty_folders(created)
        raise
    with _guard:
        _held[key] = record
    failed = True
    try:
        yield record
        failed = False
    finally:
        with _guard:
            del _held[key]
        # Unlinked while still locked: a run that opened the old file and then gets its
        # lock sees that the path now names another file, and starts again (see _acquire).
        with contextlib.suppress(OSError):
            os.unlink(lock_path(key))
        os.close(fd)
        if failed:  # a refused run leaves no folder it made: those it left empty go
            remove_empty_folders(created)


def holder(path: str | os.PathLike) -> Holder | None:
    """The process writing the store at ``path``, or None when no process is. A probe
    takes the lock for an instant when it is free; writers retry for that long."""
    key = Path(os.path.abspath(path))
    with _guard:
        if key in _held:
            return _held[key]
    try:
        fd = os.open(lock_path(key), os.O_RDWR)
    except OSError:
        return None  # no lock file (or not ours to probe): nobody is writing here
    try:
        if _try_lock(fd):
            fcntl.lockf(fd, fcntl.LOCK_UN)
            return None
        return _read_holder(fd) or Holder(0, "?", "?", str(key))
    finally:
        os.close(fd)


def _try_lock(fd: int) -> bool:
    """Take the lock on ``fd`` if no other process holds it."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        return False
    return True


def _acquire(key: Path) -> tuple[int, Holder]:
    lock = lock_path(key)
    for attempt in range(_ATTEMPTS):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError(
                f"cannot create the lock file {lock} ({exc.strerror}); choose another output dir"
            ) from exc
        if not _try_lock(fd):
            other = _read_holder(fd)
            os.close(fd)
            if attempt + 1 < _ATTEMPTS:
                time.sleep(_PAUSE)
                continue
            raise StoreBusyError(
                f"{key} is being written by {other.describe() if other else 'another process'}; "
                "wait for it to finish or stop it (its partial store resumes), and do not pass "
                "--overwrite while it runs"
            )
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                started = datetime.datetime.now(datetime.timezone.utc).isoformat("T", "seconds")
                record = Holder(os.getpid(), socket.gethostname(), started, str(key))
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(asdict(record)).encode(), 0)
                return fd, record
        os.close(fd)  # released and removed between our open and our lock
    raise StoreBusyError(f"{key} is being locked and released by other processes; try again")


def _read_holder(fd: int) -> Holder | None:
    try:
        data = json.loads(os.pread(fd, 4096, 0))
        return Holder(int(data["pid"]), str(data["host"]), str(data["started"]), data["output"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # being written this instant, or not ours
