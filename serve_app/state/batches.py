"""The batches' durable state: each batch's JSON document, its lease (which runner runs it, until
when) and its cancel request, shared by the gateway replicas.

JSON files under ``<files root>/batches`` on the embedded default (leases under an ``flock``), or
Redis (``gateway.state.redis_url``) for replicas on several nodes. The lease and the cancel request are
kept apart from the document: a runner writes the document often, and a cancel from another
replica must not be lost under those writes. What a batch is (its fields, its state machine) is
``batch/batches.py``'s business; a store reads only ``id``, ``owner``, ``created_at`` and
``status`` of a document, to list and index it.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from serve_app.state.files import write_atomic

if TYPE_CHECKING:
    import redis.asyncio

# A batch in one of these statuses is done: no runner takes it up again.
TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})


class BatchDocs(Protocol):
    """The batches' documents, leases and cancel requests.

    ``save`` writes a batch's document (``done``: no runner needs it again); ``load``, ``owned``
    and ``recent`` give documents back (newest first); ``active`` the ids of those not done, oldest
    first. ``claim`` takes a batch's lease for ``holder`` (or renews it if ``holder`` has it) and
    says whether it did; a lease lapses ``lease_s`` after its last claim, so a dead runner's batch
    is taken over."""

    async def save(self, batch_id: str, owner: str, created_at: int, done: bool,
                   doc: str) -> None: ...
    async def load(self, batch_id: str) -> bytes | None: ...
    async def owned(self, owner: str) -> list[bytes]: ...
    async def recent(self, limit: int) -> list[bytes]: ...
    async def active(self) -> list[str]: ...
    async def request_cancel(self, batch_id: str) -> None: ...
    async def cancel_requested(self, batch_id: str) -> bool: ...
    async def claim(self, batch_id: str, holder: str, lease_s: float) -> bool: ...
    async def release(self, batch_id: str, holder: str) -> None: ...


def valid_batch_id(batch_id: str) -> bool:
    """A batch id as the gateway makes them: never a path into the folder, never a Redis glob."""
    return 0 < len(batch_id) <= 64 and all(c.isalnum() or c in "_-" for c in batch_id)


class FileBatchStore:
    """Batches as JSON files under ``<root>/batches``; leases under an ``flock``, so replicas on
    one machine never both hold one. The embedded default's store without Redis."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "batches"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = self.dir / ".lock"

    def _path(self, batch_id: str, suffix: str) -> Path:
        return self.dir / f"{batch_id}{suffix}"

    async def save(self, batch_id: str, owner: str, created_at: int, done: bool,
                   doc: str) -> None:
        await asyncio.to_thread(write_atomic, self._path(batch_id, ".json"), doc.encode())

    async def load(self, batch_id: str) -> bytes | None:
        if not valid_batch_id(batch_id):
            return None
        return await asyncio.to_thread(self._load, self._path(batch_id, ".json"))

    @staticmethod
    def _load(path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def _all(self) -> Iterator[tuple[dict[str, Any], bytes]]:
        for p in self.dir.glob("*.json"):
            try:
                raw = p.read_bytes()
                doc = json.loads(raw)
            except (FileNotFoundError, ValueError):
                continue
            if isinstance(doc, dict):
                yield doc, raw

    @staticmethod
    def _newest_first(docs: Iterator[tuple[dict[str, Any], bytes]]) -> list[bytes]:
        found = sorted(docs, key=lambda d: (d[0].get("created_at", 0), d[0].get("id", "")),
                       reverse=True)
        return [raw for _, raw in found]

    # The folder is scanned in a thread: the event loop never waits on the disk.
    async def owned(self, owner: str) -> list[bytes]:
        return await asyncio.to_thread(
            lambda: self._newest_first(d for d in self._all() if d[0].get("owner") == owner))

    async def recent(self, limit: int) -> list[bytes]:
        return await asyncio.to_thread(lambda: self._newest_first(self._all())[:limit])

    async def active(self) -> list[str]:
        return await asyncio.to_thread(self._active)

    def _active(self) -> list[str]:
        live = sorted((doc.get("created_at", 0), str(doc.get("id"))) for doc, _ in self._all()
                      if doc.get("status") not in TERMINAL)
        return [batch_id for _, batch_id in live]

    async def request_cancel(self, batch_id: str) -> None:
        await asyncio.to_thread(self._path(batch_id, ".cancel").touch)

    async def cancel_requested(self, batch_id: str) -> bool:
        return await asyncio.to_thread(self._path(batch_id, ".cancel").exists)

    async def claim(self, batch_id: str, holder: str, lease_s: float) -> bool:
        return await asyncio.to_thread(self._claim, batch_id, holder, lease_s)

    def _claim(self, batch_id: str, holder: str, lease_s: float) -> bool:
        path = self._path(batch_id, ".lease")
        with open(self._lock, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                lease = json.loads(path.read_text())
            except (FileNotFoundError, ValueError):
                lease = None
            now = time.time()
            if lease is not None and lease["holder"] != holder and lease["until"] > now:
                return False
            write_atomic(path, json.dumps({"holder": holder, "until": now + lease_s}).encode())
            return True

    async def release(self, batch_id: str, holder: str) -> None:
        await asyncio.to_thread(self._release, batch_id, holder)

    def _release(self, batch_id: str, holder: str) -> None:
        path = self._path(batch_id, ".lease")
        with open(self._lock, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if json.loads(path.read_text())["holder"] == holder:
                    path.unlink()
            except (FileNotFoundError, ValueError, KeyError):
                pass


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value


REDIS_PREFIX = "serve_app:batch:"
# Take the lease if it is free or already ours; renew it either way.
_CLAIM_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


class RedisBatchStore:
    """Batches in Redis (``gateway.state.redis_url``): shared by every gateway replica on every node."""

    def __init__(self, client: redis.asyncio.Redis, prefix: str = REDIS_PREFIX) -> None:
        self._redis = client
        self._prefix = prefix
        self._claim = client.register_script(_CLAIM_LUA)
        self._release = client.register_script(_RELEASE_LUA)

    async def save(self, batch_id: str, owner: str, created_at: int, done: bool,
                   doc: str) -> None:
        p = self._prefix
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(p + batch_id, doc)
        pipe.zadd(f"{p}owner:{owner}", {batch_id: created_at})
        pipe.zadd(f"{p}all", {batch_id: created_at})
        if done:
            pipe.srem(p + "active", batch_id)
        else:
            pipe.sadd(p + "active", batch_id)
        await pipe.execute()

    async def load(self, batch_id: str) -> bytes | None:
        if not valid_batch_id(batch_id):
            return None
        raw: bytes | str | None = await self._redis.get(self._prefix + batch_id)
        return None if raw is None else _bytes(raw)

    async def owned(self, owner: str) -> list[bytes]:
        return await self._listed(f"{self._prefix}owner:{owner}", -1)

    async def recent(self, limit: int) -> list[bytes]:
        return await self._listed(f"{self._prefix}all", limit - 1)

    async def _listed(self, index: str, last: int) -> list[bytes]:
        ids = await self._redis.zrevrange(index, 0, last)
        if not ids:
            return []
        raws = await self._redis.mget([self._prefix + _text(i) for i in ids])
        return [_bytes(r) for r in raws if r is not None]

    async def active(self) -> list[str]:
        return sorted(_text(i) for i in await self._redis.smembers(self._prefix + "active"))

    async def request_cancel(self, batch_id: str) -> None:
        await self._redis.set(f"{self._prefix}cancel:{batch_id}", b"1")

    async def cancel_requested(self, batch_id: str) -> bool:
        return bool(await self._redis.exists(f"{self._prefix}cancel:{batch_id}"))

    async def claim(self, batch_id: str, holder: str, lease_s: float) -> bool:
        got = await self._claim(keys=[f"{self._prefix}lease:{batch_id}"],
                                args=[holder, int(lease_s * 1000)])
        return bool(got)

    async def release(self, batch_id: str, holder: str) -> None:
        await self._release(keys=[f"{self._prefix}lease:{batch_id}"], args=[holder])
