"""The alias lock: one queue for every process that moves a registry's aliases.

MLflow's alias and tag writes are unconditional (last writer wins), so a compare-and-set built from them
would still race; alias writes are serialized by a lock instead. `AliasLock` is an exclusive `flock` on
a file beside the registry's state: reentrant within a thread and released by the kernel when its holder
dies. A file lock does not reach across hosts, so a fleet on PostgreSQL uses `PostgresAliasLock`, a
session advisory lock; `AliasLock.for_path` takes a file path or a `postgresql+psycopg://` URL.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

from registry.tracking import sqlite_path

DEFAULT_LOCK_TIMEOUT_S = 120.0


class AliasLockTimeout(RuntimeError):
    """Another process held the alias lock for longer than this one was willing to wait."""


class _ReentrantLock:
    """An inter-process lock, reentrant within a thread: other threads of the process wait on an in-process
    lock first. A subclass takes (`_take`, by `deadline` or AliasLockTimeout) and releases (`_release`) the
    lock itself, and names it (`path`)."""

    path: Any
    _instances: ClassVar[dict[tuple[type, str], Any]] = {}
    _instances_guard = threading.Lock()

    def __init__(self) -> None:
        self._guard = threading.RLock()
        self._depth = 0
        self._handle: Any = None

    @classmethod
    def _shared(cls, key: str, *args: Any) -> Any:
        """The one instance of `cls` for `key` in this process, made with `args` the first time."""
        with _ReentrantLock._instances_guard:
            lock = _ReentrantLock._instances.get((cls, key))
            if lock is None:
                lock = _ReentrantLock._instances[(cls, key)] = cls(*args)
            return lock

    def _take(self, deadline: float, timeout_s: float) -> Any:
        raise NotImplementedError

    def _release(self, handle: Any) -> None:
        raise NotImplementedError

    @contextmanager
    def held(self, timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> Iterator[Any]:
        """Hold the lock (waiting up to `timeout_s`, then AliasLockTimeout) for the `with` block."""
        deadline = time.monotonic() + timeout_s
        if not self._guard.acquire(timeout=timeout_s):
            raise AliasLockTimeout(f"another thread held the alias lock {self.path} for {timeout_s:.1f}s")
        try:
            if self._depth == 0:
                self._handle = self._take(deadline, timeout_s)
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
                if self._depth == 0 and self._handle is not None:
                    handle, self._handle = self._handle, None
                    self._release(handle)
        finally:
            self._guard.release()


class AliasLock(_ReentrantLock):
    """An exclusive file lock that every alias writer of a registry takes (see the module docstring).

    Reentrant within a thread; other threads of the process wait on an in-process lock first, since
    `flock` would let two threads of one process deadlock on separate descriptors. One instance per
    path and process (`for_path`).
    """

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    @classmethod
    def for_path(cls, path: str | Path) -> AliasLock | PostgresAliasLock:
        """The lock at a file path, or in the PostgreSQL database a `postgresql+psycopg://` URL names."""
        if is_postgres_location(path):
            return PostgresAliasLock.for_url(str(path))
        path = Path(path).resolve()
        return cls._shared(str(path), path)

    def _take(self, deadline: float, timeout_s: float) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        delay = 0.01
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())  # who holds it, for whoever waits
                return fd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    holder = self.path.read_text().strip() if self.path.exists() else "?"
                    raise AliasLockTimeout(f"the alias lock {self.path} stayed held (by pid {holder or '?'}) "
                                           f"for {timeout_s:.1f}s; no alias was written") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
            except BaseException:
                os.close(fd)
                raise

    def _release(self, fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def is_postgres_location(location: str | Path) -> bool:
    """Whether a lock location is a PostgreSQL URL rather than a file path."""
    return isinstance(location, str) and location.startswith(("postgresql://", "postgresql+psycopg://"))


class PostgresAliasLock(_ReentrantLock):
    """The alias lock as a session advisory lock in a PostgreSQL database: one queue across hosts.

    Held on a connection of its own for the `with` block; the server releases it when that connection
    ends, so a killed holder never leaves it stale. Reentrant within a thread, like `AliasLock`. One
    instance per URL and process (`for_url`).
    """

    KEY = 0x4C454150_414C4941  # "LEAPALIA": every alias writer of the database's fleet takes this one
    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url

    @classmethod
    def for_url(cls, url: str) -> PostgresAliasLock:
        return cls._shared(url, url)

    @property
    def path(self) -> str:
        """Where the lock lives, for messages (the URL without its password)."""
        from leap_io.redact import redact_url

        return redact_url(self.url)

    def _take(self, deadline: float, timeout_s: float):
        import psycopg

        con = psycopg.connect(self.url.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True,
                              connect_timeout=max(1, int(min(timeout_s, 30))))
        delay = 0.01
        try:
            while not con.execute("SELECT pg_try_advisory_lock(%s)", [self.KEY]).fetchone()[0]:
                if time.monotonic() >= deadline:
                    raise AliasLockTimeout(f"the alias lock in {self.path} stayed held for {timeout_s:.1f}s; "
                                           "no alias was written")
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        except BaseException:
            con.close()
            raise
        return con

    def _release(self, con: Any) -> None:
        with contextlib.suppress(Exception):  # closing the connection releases it anyway
            con.execute("SELECT pg_advisory_unlock(%s)", [self.KEY])
        con.close()


class AliasLockHandle:
    """One registry's view of the shared `AliasLock`: the same lock, with its own patience."""

    def __init__(self, lock: AliasLock | PostgresAliasLock, timeout_s: float) -> None:
        self.lock, self.timeout_s = lock, timeout_s

    @property
    def path(self) -> Path | str:
        return self.lock.path

    def held(self) -> contextlib.AbstractContextManager[AliasLock | PostgresAliasLock]:
        return self.lock.held(self.timeout_s)


def default_lock_path(tracking_uri: str) -> Path:
    """Next to a sqlite database; for a server, one file per server URI in the temporary folder."""
    db_path = sqlite_path(tracking_uri)
    if db_path is not None:
        return db_path.resolve().parent / "aliases.lock"
    digest = hashlib.sha256(tracking_uri.rstrip("/").encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"leap-mlflow-aliases-{digest}.lock"
