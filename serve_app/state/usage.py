"""Usage totals per key: integer fields added up (``requests``, ``prompt_tokens``, ...).

In process for one gateway replica, in Redis hashes when replicas share Redis (so that every
replica answers ``/v1/usage`` with the same numbers), or in SQLite (``<gateway.state.dir>/usage.sqlite``)
when there is no Redis: durable through a SIGKILL of the replica, and shared by the replicas of
one host. The stores do not own their connections: ``Connections.close`` gives them back.
"""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from typing import TYPE_CHECKING, Protocol

from serve_app.state.connections import SqliteFile

if TYPE_CHECKING:
    import redis.asyncio

USAGE_FILE = "usage.sqlite"  # shared with the budgets (state/budgets.py)
REDIS_PREFIX = "serve-app:usage:"


class UsageStore(Protocol):
    """Per-key totals: ``add`` increments fields, ``get`` reads them all."""

    async def add(self, key_id: str, fields: dict[str, int]) -> None: ...
    async def get(self, key_id: str) -> dict[str, int]: ...


class MemoryUsageStore:
    """One replica's totals in memory (lost with it)."""

    def __init__(self) -> None:
        self._totals: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    async def add(self, key_id: str, fields: dict[str, int]) -> None:
        for k, v in fields.items():
            self._totals[key_id][k] += v

    async def get(self, key_id: str) -> dict[str, int]:
        return dict(self._totals.get(key_id, {}))


class RedisUsageStore:
    """Totals in one Redis hash per key, shared by every gateway replica."""

    def __init__(self, client: redis.asyncio.Redis, prefix: str = REDIS_PREFIX) -> None:
        self._redis = client
        self._prefix = prefix

    async def add(self, key_id: str, fields: dict[str, int]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for k, v in fields.items():
            pipe.hincrby(self._prefix + key_id, k, v)
        await pipe.execute()

    async def get(self, key_id: str) -> dict[str, int]:
        raw = await self._redis.hgetall(self._prefix + key_id)
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}


class SqliteUsageStore:
    """Totals in the ``usage`` table of a SQLite file: each ``add`` is one transaction, run in a
    thread (``SqliteFile.write``) so the event loop never waits on the file."""

    def __init__(self, file: SqliteFile) -> None:
        self._file = file
        self._ready = False  # the table is created on first use, in the file's thread

    def _schema(self, db: sqlite3.Connection) -> None:
        if not self._ready:
            db.execute("CREATE TABLE IF NOT EXISTS usage (key_id TEXT, field TEXT, value INTEGER, "
                       "PRIMARY KEY (key_id, field))")
            self._ready = True

    async def add(self, key_id: str, fields: dict[str, int]) -> None:
        def add(db: sqlite3.Connection) -> None:
            self._schema(db)
            db.executemany(
                "INSERT INTO usage VALUES (?, ?, ?) ON CONFLICT(key_id, field) DO UPDATE "
                "SET value = value + excluded.value",
                [(key_id, k, v) for k, v in fields.items()])

        await self._file.write(add)

    async def get(self, key_id: str) -> dict[str, int]:
        def get(db: sqlite3.Connection) -> dict[str, int]:
            self._schema(db)
            rows = db.execute("SELECT field, value FROM usage WHERE key_id = ?", (key_id,))
            return {f: int(v) for f, v in rows.fetchall()}

        return await self._file.run(get)
