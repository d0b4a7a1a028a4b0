"""The MLflow store under :mod:`jagg_core.pipeline.tracking`: where it is, how a first SQLite store is created by one
process, and what its failures say to the user (one sentence each, credentials redacted)."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Iterator

from ..setup.redact import redact
from ..errors import UserError
from ..setup.storage import open_lock_file, read_head, read_text

__all__ = ["TrackingError", "artifact_location", "check_sqlite_store", "resolve_uri", "shown", "sqlite_path",
           "store_creation_lock", "store_failure"]


class TrackingError(UserError, RuntimeError):
    """The tracking store cannot be used; the message is for the user."""


def resolve_uri(uri: str, root: str | os.PathLike) -> str:
    """Relative ``sqlite:///x.db`` paths are taken relative to the repository root and made absolute."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + str((Path(root) / uri[len(prefix):]).resolve())
    return uri


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` store (its query string left out); None for any other store."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///").split("?", 1)[0])


def artifact_location(uri: str, experiment: str) -> str | None:
    """Where a new experiment of a SQLite store keeps its artifacts: ``mlruns/<experiment>`` beside the database.
    (MLflow's default is ``./mlruns`` of whatever folder the process runs in, so a stage started from elsewhere, or a
    test, would scatter artifacts there.) Other stores choose their own (``None``)."""
    db = sqlite_path(uri)
    if db is None:
        return None
    return (db.parent / "mlruns" / re.sub(r"[^A-Za-z0-9._-]", "_", experiment)).as_uri()


@contextlib.contextmanager
def store_creation_lock(uri: str, wait_s: float = 120.0) -> Iterator[None]:
    """For a SQLite store, an exclusive lock beside the database while a process opens it: the first creates the
    tables (MLflow's migrations are not safe to run twice at once) and the experiment; the others then find them.
    The wait has a deadline (``tracking.lock_wait_s``): a lock held longer (a stuck or stopped process opening the
    store) is one sentence naming the lock file and its holder, before anything is written (it waited for ever)."""
    db = sqlite_path(uri)
    if db is None:
        yield
        return
    import fcntl

    db.parent.mkdir(parents=True, exist_ok=True)
    lock = db.with_name(db.name + ".lock")
    # A regular file, opened without blocking and never through a link (a FIFO there hung `jagg train`).
    fd = open_lock_file(lock, TrackingError, fix=f"remove it (rm {lock}), then run again")
    try:
        _acquire(fd, lock, db, wait_s)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _acquire(fd: int, lock: Path, db: Path, wait_s: float) -> None:
    """``flock(fd, LOCK_EX)`` polled without blocking until ``wait_s`` seconds have passed, then one sentence."""
    import fcntl
    import time

    deadline, delay = time.monotonic() + wait_s, 0.02
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                break
            time.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
            delay = min(delay * 2, 0.5)
    holder = lock_holder(fd)
    who = f"process {holder}" if holder else "another process"
    stop = f"stop it (kill {holder})" if holder else f"stop it (fuser {lock} names it)"
    raise TrackingError(f"the MLflow store {db} could not be opened: {who} has held its lock file {lock} for over "
                        f"{wait_s:g} s (tracking.lock_wait_s; a flock ends with the process that holds it); wait for "
                        f"that process or {stop}, then run again.")


def lock_holder(fd: int) -> int | None:
    """The id of a process holding a ``flock`` on the file open as ``fd`` (Linux's /proc/locks), else None."""
    info = os.fstat(fd)
    try:
        text = read_text("/proc/locks", OSError)
    except OSError:  # not Linux
        return None
    for line in text.splitlines():
        parts = line.split()
        if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK":
            continue
        try:
            major, minor, inode = parts[5].split(":")
            if (int(inode) == info.st_ino and int(major, 16) == os.major(info.st_dev)
                    and int(minor, 16) == os.minor(info.st_dev) and int(parts[4]) != os.getpid()):
                return int(parts[4])
        except ValueError:
            continue
    return None


def shown(uri: str) -> str:
    """The store's URI as it may be printed: credentials in it redacted (``http://user:***@host/``)."""
    return redact(uri)


def check_sqlite_store(uri: str) -> None:
    """A SQLite store that is a folder, or a file that is not a SQLite database, is one sentence before MLflow opens
    it (MLflow would answer with a long SQLAlchemy traceback)."""
    db = sqlite_path(uri)
    if db is None:
        return
    if db.is_dir():
        raise TrackingError(f"the MLflow store {db} is a folder, not a SQLite file; move it aside or set "
                            f"tracking.mlflow_uri to another file.")
    if db.is_file() and db.stat().st_size:
        header = read_head(db, 16, TrackingError, fix="move it aside or set tracking.mlflow_uri to another file")
        if header != b"SQLite format 3\x00":
            raise TrackingError(f"the MLflow store {db} is not a SQLite database (damaged?); move it aside "
                                f"(mv {db} {db}.damaged) to start a fresh store, or set tracking.mlflow_uri.")


def store_failure(uri: str, what: str, e: BaseException) -> str:
    """One sentence for a store that failed every retry: what it is, which store, and the fix."""
    text = " ".join(str(e).split())
    db = sqlite_path(uri)
    if db is not None:
        if "locked" in text:
            return (f"the MLflow store {db} cannot {what}: another process holds it locked; stop that process (or "
                    f"wait for it) and run again.")
        if "malformed" in text or "not a database" in text:
            return (f"the MLflow store {db} is damaged ({type(e).__name__}); move it aside (mv {db} {db}.damaged) to "
                    f"start a fresh store, or set tracking.mlflow_uri.")
    detail = redact(text[:200])
    return (f"the MLflow store {shown(uri)} cannot {what} ({type(e).__name__}: {detail}); check "
            f"tracking.mlflow_uri or start the server.")
