"""LoRA adapters added at run time (``/admin/v1/adapters``), by name: Redis when the replicas
share one, else ``adapters.sqlite`` in the state folder, else this process's memory. A document is
the adapter's JSON (``gateway.routing.adapters``); the store keeps bytes and knows nothing of it.

They outlive every replica: a gateway reads them at start and every few seconds, and a model
replica loads an adapter when its first request arrives, so a restarted replica or a new
``serve deploy`` serves the same adapters."""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING, Protocol

from serve_app.state.connections import SqliteFile

if TYPE_CHECKING:
    import redis.asyncio

ADAPTERS_FILE = "adapters.sqlite"
REDIS_KEY = "serve_app:adapters"


class AdapterDocs(Protocol):
    """``add`` stores a new adapter and says False (storing nothing) when the name is taken;
    ``all`` gives every adapter by name; ``delete`` says whether there was one."""

    async def add(self, name: str, doc: bytes) -> bool: ...
    async def all(self) -> dict[str, bytes]: ...
    async def delete(self, name: str) -> bool: ...


class MemoryAdapterStore:
    """One gateway replica's adapters, lost at its restart."""

    def __init__(self) -> None:
        self._docs: dict[str, bytes] = {}

    async def add(self, name: str, doc: bytes) -> bool:
        if name in self._docs:
            return False
        self._docs[name] = doc
        return True

    async def all(self) -> dict[str, bytes]:
        return dict(self._docs)

    async def delete(self, name: str) -> bool:
        return self._docs.pop(name, None) is not None


class SqliteAdapterStore:
    """Adapters in a SQLite file: durable on one host."""

    def __init__(self, file: SqliteFile) -> None:
        self._file = file
        self._ready = False

    def _schema(self, db: sqlite3.Connection) -> None:
        if not self._ready:
            db.execute("CREATE TABLE IF NOT EXISTS adapters (name TEXT PRIMARY KEY, doc BLOB)")
            self._ready = True

    async def add(self, name: str, doc: bytes) -> bool:
        def add(db: sqlite3.Connection) -> bool:
            self._schema(db)
            return db.execute("INSERT OR IGNORE INTO adapters VALUES (?, ?)", (name, doc)).rowcount > 0

        return await self._file.write(add)

    async def all(self) -> dict[str, bytes]:
        def read(db: sqlite3.Connection) -> dict[str, bytes]:
            self._schema(db)
            return {str(n): bytes(d) for n, d in db.execute("SELECT name, doc FROM adapters")}

        return await self._file.run(read)

    async def delete(self, name: str) -> bool:
        def delete(db: sqlite3.Connection) -> bool:
            self._schema(db)
            return db.execute("DELETE FROM adapters WHERE name = ?", (name,)).rowcount > 0

        return await self._file.write(delete)


class RedisAdapterStore:
    """Adapters in one Redis hash: shared by every gateway replica on every node."""

    def __init__(self, client: redis.asyncio.Redis, key: str = REDIS_KEY) -> None:
        self._redis = client
        self._key = key

    async def add(self, name: str, doc: bytes) -> bool:
        return bool(await self._redis.hsetnx(self._key, name, doc))

    async def all(self) -> dict[str, bytes]:
        raw = await self._redis.hgetall(self._key)
        return {(n.decode() if isinstance(n, bytes) else str(n)): (d if isinstance(d, bytes) else str(d).encode())
                for n, d in raw.items()}

    async def delete(self, name: str) -> bool:
        return bool(await self._redis.hdel(self._key, name))
