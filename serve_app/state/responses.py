"""Stored Responses (OpenAI's Responses API with ``store``): each response's JSON document, the
events of a background response (for ``GET ...?stream=true&starting_after=N``) and its cancel
request, shared by the gateway replicas and kept past their restarts.

Redis (``gateway.state.redis_url``) when replicas share one, else a SQLite file in
``gateway.state.dir`` (one host), else memory (lost at a restart; the embedded default always has a
state folder). Every entry expires ``ttl_s`` after its last write. What a stored response is (its
fields, whose it is) is ``gateway/responses``'s business: a store keeps bytes under an id.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from serve_app.state.connections import SqliteFile

if TYPE_CHECKING:
    import redis.asyncio

RESPONSES_FILE = "responses.sqlite"
REDIS_PREFIX = "serve_app:resp:"
PURGE_EVERY_S = 60.0  # how often the SQLite store deletes expired entries (on a write)


class ResponseDocs(Protocol):
    """The stored responses. ``put`` writes a response's document (and renews its expiry);
    ``get`` gives it back, None when unknown or expired; ``delete`` drops the document, its events
    and its cancel request and says whether there was one. ``append`` adds a background response's
    events (in order: an event's index is its ``sequence_number``) and ``events`` gives those after
    index ``after`` (-1: all)."""

    async def put(self, resp_id: str, doc: bytes, ttl_s: float) -> None: ...
    async def get(self, resp_id: str) -> bytes | None: ...
    async def delete(self, resp_id: str) -> bool: ...
    async def append(self, resp_id: str, events: list[bytes], ttl_s: float) -> None: ...
    async def events(self, resp_id: str, after: int) -> list[bytes]: ...
    async def event_count(self, resp_id: str) -> int: ...
    async def request_cancel(self, resp_id: str, ttl_s: float) -> None: ...
    async def cancel_requested(self, resp_id: str) -> bool: ...


def valid_response_id(resp_id: str) -> bool:
    """An id as the gateway makes them (``resp_`` and hex): never a Redis glob or a SQL trick."""
    return (resp_id.startswith("resp_") and 5 < len(resp_id) <= 64
            and all(c.isalnum() or c in "_-" for c in resp_id))


class MemoryResponseStore:
    """Responses in this process's memory: one gateway replica, lost at its restart."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._docs: dict[str, tuple[float, bytes]] = {}
        self._events: dict[str, list[bytes]] = {}
        self._cancels: set[str] = set()

    def _live(self, resp_id: str) -> bytes | None:
        entry = self._docs.get(resp_id)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            self._drop(resp_id)
            return None
        return entry[1]

    def _drop(self, resp_id: str) -> bool:
        self._events.pop(resp_id, None)
        self._cancels.discard(resp_id)
        return self._docs.pop(resp_id, None) is not None

    async def put(self, resp_id: str, doc: bytes, ttl_s: float) -> None:
        now = self._clock()
        for old in [k for k, (exp, _) in self._docs.items() if exp <= now]:
            self._drop(old)
        self._docs[resp_id] = (now + ttl_s, doc)

    async def get(self, resp_id: str) -> bytes | None:
        return self._live(resp_id)

    async def delete(self, resp_id: str) -> bool:
        return self._drop(resp_id)

    async def append(self, resp_id: str, events: list[bytes], ttl_s: float) -> None:
        self._events.setdefault(resp_id, []).extend(events)

    async def events(self, resp_id: str, after: int) -> list[bytes]:
        return list(self._events.get(resp_id, [])[max(after + 1, 0):])

    async def event_count(self, resp_id: str) -> int:
        return len(self._events.get(resp_id, []))

    async def request_cancel(self, resp_id: str, ttl_s: float) -> None:
        self._cancels.add(resp_id)

    async def cancel_requested(self, resp_id: str) -> bool:
        return resp_id in self._cancels


class SqliteResponseStore:
    """Responses in a SQLite file (``responses.sqlite`` in the state folder): durable on one host."""

    def __init__(self, file: SqliteFile, clock: Callable[[], float] = time.time) -> None:
        self._file = file
        self._clock = clock
        self._ready = False
        self._purged = float("-inf")

    def _schema(self, db: sqlite3.Connection) -> None:
        if not self._ready:
            db.execute("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, doc BLOB, "
                       "expires_at REAL, cancel INTEGER DEFAULT 0)")
            db.execute("CREATE TABLE IF NOT EXISTS response_events (id TEXT, seq INTEGER, "
                       "data BLOB, PRIMARY KEY (id, seq))")
            self._ready = True

    def _purge(self, db: sqlite3.Connection, now: float) -> None:
        if now - self._purged < PURGE_EVERY_S:
            return
        self._purged = now
        db.execute("DELETE FROM response_events WHERE id IN "
                   "(SELECT id FROM responses WHERE expires_at <= ?)", (now,))
        db.execute("DELETE FROM responses WHERE expires_at <= ?", (now,))

    async def put(self, resp_id: str, doc: bytes, ttl_s: float) -> None:
        def put(db: sqlite3.Connection) -> None:
            self._schema(db)
            now = self._clock()
            self._purge(db, now)
            db.execute("INSERT INTO responses (id, doc, expires_at) VALUES (?, ?, ?) "
                       "ON CONFLICT(id) DO UPDATE SET doc = excluded.doc, "
                       "expires_at = excluded.expires_at", (resp_id, doc, now + ttl_s))

        await self._file.write(put)

    async def get(self, resp_id: str) -> bytes | None:
        def get(db: sqlite3.Connection) -> bytes | None:
            self._schema(db)
            row = db.execute("SELECT doc FROM responses WHERE id = ? AND expires_at > ?",
                             (resp_id, self._clock())).fetchone()
            return None if row is None else bytes(row[0])

        return await self._file.run(get)

    async def delete(self, resp_id: str) -> bool:
        def delete(db: sqlite3.Connection) -> bool:
            self._schema(db)
            db.execute("DELETE FROM response_events WHERE id = ?", (resp_id,))
            return db.execute("DELETE FROM responses WHERE id = ?", (resp_id,)).rowcount > 0

        return await self._file.write(delete)

    async def append(self, resp_id: str, events: list[bytes], ttl_s: float) -> None:
        def append(db: sqlite3.Connection) -> None:
            self._schema(db)
            row = db.execute("SELECT COUNT(*) FROM response_events WHERE id = ?",
                             (resp_id,)).fetchone()
            start = int(row[0])
            db.executemany("INSERT INTO response_events VALUES (?, ?, ?)",
                           [(resp_id, start + i, e) for i, e in enumerate(events)])

        await self._file.write(append)

    async def events(self, resp_id: str, after: int) -> list[bytes]:
        def events(db: sqlite3.Connection) -> list[bytes]:
            self._schema(db)
            rows = db.execute("SELECT data FROM response_events WHERE id = ? AND seq > ? "
                              "ORDER BY seq", (resp_id, after)).fetchall()
            return [bytes(r[0]) for r in rows]

        return await self._file.run(events)

    async def event_count(self, resp_id: str) -> int:
        def count(db: sqlite3.Connection) -> int:
            self._schema(db)
            row = db.execute("SELECT COUNT(*) FROM response_events WHERE id = ?", (resp_id,)).fetchone()
            return int(row[0])

        return await self._file.run(count)

    async def request_cancel(self, resp_id: str, ttl_s: float) -> None:
        def cancel(db: sqlite3.Connection) -> None:
            self._schema(db)
            db.execute("UPDATE responses SET cancel = 1 WHERE id = ?", (resp_id,))

        await self._file.write(cancel)

    async def cancel_requested(self, resp_id: str) -> bool:
        def asked(db: sqlite3.Connection) -> bool:
            self._schema(db)
            row = db.execute("SELECT cancel FROM responses WHERE id = ?", (resp_id,)).fetchone()
            return bool(row and row[0])

        return await self._file.run(asked)


def _bytes(raw: bytes | str) -> bytes:
    return raw if isinstance(raw, bytes) else raw.encode()


class RedisResponseStore:
    """Responses in Redis: shared by every gateway replica on every node; Redis expires them."""

    def __init__(self, client: redis.asyncio.Redis, prefix: str = REDIS_PREFIX) -> None:
        self._redis = client
        self._prefix = prefix

    def _keys(self, resp_id: str) -> tuple[str, str, str]:
        p = self._prefix + resp_id
        return p, p + ":events", p + ":cancel"

    async def put(self, resp_id: str, doc: bytes, ttl_s: float) -> None:
        ttl_ms = int(ttl_s * 1000)
        doc_key, events_key, _ = self._keys(resp_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(doc_key, doc, px=ttl_ms)
        pipe.pexpire(events_key, ttl_ms)
        await pipe.execute()

    async def get(self, resp_id: str) -> bytes | None:
        raw: bytes | str | None = await self._redis.get(self._keys(resp_id)[0])
        return None if raw is None else _bytes(raw)

    async def delete(self, resp_id: str) -> bool:
        return bool(await self._redis.delete(*self._keys(resp_id)) > 0)

    async def append(self, resp_id: str, events: list[bytes], ttl_s: float) -> None:
        events_key = self._keys(resp_id)[1]
        pipe = self._redis.pipeline(transaction=True)
        pipe.rpush(events_key, *events)
        pipe.pexpire(events_key, int(ttl_s * 1000))
        await pipe.execute()

    async def events(self, resp_id: str, after: int) -> list[bytes]:
        raws = await self._redis.lrange(self._keys(resp_id)[1], max(after + 1, 0), -1)
        return [_bytes(r) for r in raws]

    async def event_count(self, resp_id: str) -> int:
        return int(await self._redis.llen(self._keys(resp_id)[1]))

    async def request_cancel(self, resp_id: str, ttl_s: float) -> None:
        await self._redis.set(self._keys(resp_id)[2], b"1", px=int(ttl_s * 1000))

    async def cancel_requested(self, resp_id: str) -> bool:
        return bool(await self._redis.exists(self._keys(resp_id)[2]))
