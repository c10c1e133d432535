"""The one place that opens the state's connections: one Redis pool, one SQLite connection per file.

Every store under ``serve_app.state`` gets its connection here, so a gateway replica holds at most
one Redis connection pool (shared by keys, limits, usage, budgets and batches) and one SQLite
connection per file (WAL, ``synchronous=NORMAL``). A SQLite connection is used from worker threads
(``asyncio.to_thread``) under its own lock, so the event loop never waits on the file.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from serve_app.config import StateConfig

if TYPE_CHECKING:
    import redis.asyncio

T = TypeVar("T")

REDIS_SOCKET_TIMEOUT_S = 5.0
REDIS_CONNECT_TIMEOUT_S = 2.0


class SqliteFile:
    """One SQLite connection to one file, used from threads under one lock.

    ``run(fn)`` calls ``fn(connection)`` in a worker thread while holding the lock; ``write(fn)``
    does the same inside one ``BEGIN IMMEDIATE`` transaction (rolled back if ``fn`` raises)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.lock = threading.Lock()
        self._closed = False

    def run_sync(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        with self.lock:
            return fn(self.db)

    def write_sync(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                result = fn(self.db)
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            return result

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.to_thread(self.run_sync, fn)

    async def write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.to_thread(self.write_sync, fn)

    def close(self) -> None:
        with self.lock:
            if not self._closed:
                self._closed = True
                self.db.close()


class Connections:
    """The state's connections of one process: Redis (one async pool, opened on first use) when a
    URL is configured, and SQLite files under ``state_dir`` (one connection per file)."""

    def __init__(self, redis_url: str | None, state_dir: Path | None) -> None:
        self.redis_url = redis_url
        self.state_dir = state_dir
        self._redis: redis.asyncio.Redis | None = None
        self._files: dict[Path, SqliteFile] = {}
        self._files_lock = threading.Lock()

    @classmethod
    def of(cls, state: StateConfig) -> Connections:
        """The connections ``gateway.state`` names (its ``redis_url`` and ``dir``)."""
        return cls(state.redis_url, Path(state.dir) if state.dir else None)

    def redis(self) -> redis.asyncio.Redis:
        """The one async Redis client (its connection pool is shared by every store)."""
        if self.redis_url is None:
            raise RuntimeError("no redis_url is configured")
        if self._redis is None:
            import redis.asyncio as aioredis

            self._redis = aioredis.Redis.from_url(
                self.redis_url, socket_timeout=REDIS_SOCKET_TIMEOUT_S,
                socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S)
        return self._redis

    def sqlite(self, path: Path | str) -> SqliteFile:
        """The one connection to ``path`` (relative paths are under ``state_dir``)."""
        p = Path(path)
        if not p.is_absolute():
            if self.state_dir is None:
                raise RuntimeError(f"no state_dir for {p}")
            p = self.state_dir / p
        p = p.resolve()
        with self._files_lock:
            f = self._files.get(p)
            if f is None:
                f = self._files[p] = SqliteFile(p)
            return f

    async def close(self) -> None:
        """Give the connections back (at the replica's stop). Safe to call twice."""
        client, self._redis = self._redis, None
        if client is not None:
            await client.aclose()
        with self._files_lock:
            files, self._files = list(self._files.values()), {}
        for f in files:
            f.close()


