"""Key stores and the key operations that the admin API and ``serve-app keys`` share.

A ``KeyStore`` holds ``KeyRecord``s (digests only, never a secret) and answers a gateway's lookup
by secret from memory. Three stores:

- the YAML keys file (``keys.KeyStore``): one host, editable by hand or Git; may be read-only;
- SQLite in ``gateway.state_dir`` (``SqliteKeyStore``): one host, durable with nothing installed
  (Python's sqlite3), shared by every gateway replica on the host through the file;
- Redis at ``gateway.redis_url`` (``RedisKeyStore``): a cluster.

The database stores bump a version number on every write; each replica polls it every
``POLL_S`` and reloads on a change, so a created key answers on every replica within about
``POLL_S`` and a revoked one stops as fast. ``KeyOps`` is the one implementation of create, rotate,
revoke and update over any store.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from serve_app.config import GatewayConfig, KeyRecord, format_validation_error
from serve_app.gateway.keys import keyfile as keys_file
from serve_app.gateway.keys.auth import digest, new_secret, same_digest
from serve_app.gateway.keys.keyfile import KeyConflict, KeyInvalid, KeyNotFound, StoreReadOnly

logger = logging.getLogger("ray.serve")

POLL_S = 0.25  # how often a replica asks a database store whether keys changed (one cheap read)


class KeyStore(Protocol):
    """Where keys live. ``lookup`` runs on every request and is answered from memory (refreshed
    when the store changes); ``records`` and ``write`` read and change the store itself.
    ``write`` raises ``KeyConflict`` (a new id exists), ``KeyNotFound`` (replacing an unknown id)
    or ``StoreReadOnly``."""

    read_only: bool

    @property
    def location(self) -> str: ...
    def lookup(self, secret: str) -> KeyRecord | None: ...
    def by_id(self, key_id: str) -> KeyRecord | None: ...
    def records(self) -> tuple[KeyRecord, ...]: ...
    def write(self, record: KeyRecord, *, new: bool) -> None: ...
    def close(self) -> None: ...


def _record(doc: str) -> KeyRecord:
    return KeyRecord.model_validate_json(doc)


def _doc(record: KeyRecord) -> str:
    return record.model_dump_json(exclude_none=True)


class _Cached:
    """The active keys by digest, reloaded when ``version()`` changes (asked at most every
    ``POLL_S``). A store that cannot be read keeps serving the keys it had."""

    def __init__(self, version: Callable[[], Any], load: Callable[[], tuple[KeyRecord, ...]],
                 clock: Callable[[], float]) -> None:
        self._version, self._load, self._clock = version, load, clock
        self._by_digest: dict[str, KeyRecord] = {}
        self._seen: Any = object()
        self._checked = float("-inf")
        self._lock = threading.Lock()

    def refresh(self, force: bool = False) -> None:
        if not force and self._clock() - self._checked < POLL_S:
            return
        with self._lock:
            if not force and self._clock() - self._checked < POLL_S:
                return
            try:
                version = self._version()
                if force or version != self._seen:
                    self._by_digest = {k.digest: k for k in self._load() if not k.revoked}
                    self._seen = version
            except Exception as exc:
                logger.error("keys not reloaded: %s", exc.__class__.__name__)
            self._checked = self._clock()

    def by_id(self, key_id: str) -> KeyRecord | None:
        self.refresh()
        return next((k for k in self._by_digest.values() if k.id == key_id), None)

    def lookup(self, secret: str) -> KeyRecord | None:
        self.refresh()
        d = digest(secret)
        record = self._by_digest.get(d)
        if record is None or not same_digest(record.digest, d):
            return None
        return record


class SqliteKeyStore:
    """Keys in ``<state_dir>/keys.sqlite``: durable, and shared by the gateway replicas of a host."""

    def __init__(self, path: Path, *, read_only: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.read_only = read_only
        # One connection per thread is not needed: every call takes the lock, and sqlite3's
        # default check is relaxed so FastAPI's thread pool and the event loop may share it.
        self._db = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS keys (id TEXT PRIMARY KEY, doc TEXT NOT NULL)")
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER)")
        self._db.execute("INSERT OR IGNORE INTO meta VALUES ('version', 0)")
        self._io = threading.Lock()
        self._cache = _Cached(self._version, self.records, clock)
        self._cache.refresh(force=True)

    @property
    def location(self) -> str:
        return str(self.path)

    def _version(self) -> int:
        with self._io:
            row = self._db.execute("SELECT value FROM meta WHERE name = 'version'").fetchone()
        return int(row[0])

    def lookup(self, secret: str) -> KeyRecord | None:
        return self._cache.lookup(secret)

    def by_id(self, key_id: str) -> KeyRecord | None:
        """The active key with this id (a batch's lines are charged to it while it stays so)."""
        return self._cache.by_id(key_id)

    def records(self) -> tuple[KeyRecord, ...]:
        with self._io:
            rows = self._db.execute("SELECT doc FROM keys ORDER BY rowid").fetchall()
        return tuple(_record(r[0]) for r in rows)

    def write(self, record: KeyRecord, *, new: bool) -> None:
        if self.read_only:
            raise StoreReadOnly("keys are read-only here (gateway.keys_read_only)")
        with self._io:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                exists = self._db.execute("SELECT 1 FROM keys WHERE id = ?", (record.id,)).fetchone()
                if new and exists:
                    raise KeyConflict(f"key id {record.id!r} already exists; revoke it or choose "
                                      "another id")
                if not new and not exists:
                    raise KeyNotFound(f"no key with id {record.id!r}")
                self._db.execute("INSERT OR REPLACE INTO keys VALUES (?, ?)", (record.id, _doc(record)))
                self._db.execute("UPDATE meta SET value = value + 1 WHERE name = 'version'")
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        self._cache.refresh(force=True)

    def close(self) -> None:
        self._db.close()


class RedisKeyStore:
    """Keys in one Redis hash (id -> record JSON) and a version counter: every gateway replica of
    a cluster sees a change within ``POLL_S``. Synchronous: lookups are served from memory, and
    only the poll (one GET) and admin writes reach Redis."""

    def __init__(self, url: str, *, read_only: bool = False, prefix: str = "serve-app:keys",
                 clock: Callable[[], float] = time.monotonic) -> None:
        import redis

        self._redis = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._url = url
        self._hash, self._ver = prefix, prefix + ":version"
        self.read_only = read_only
        self._cache = _Cached(lambda: self._redis.get(self._ver), self.records, clock)
        self._cache.refresh(force=True)

    @property
    def location(self) -> str:
        return f"redis hash {self._hash}"

    def lookup(self, secret: str) -> KeyRecord | None:
        return self._cache.lookup(secret)

    def by_id(self, key_id: str) -> KeyRecord | None:
        """The active key with this id (a batch's lines are charged to it while it stays so)."""
        return self._cache.by_id(key_id)

    def records(self) -> tuple[KeyRecord, ...]:
        raw: dict[bytes, bytes] = self._redis.hgetall(self._hash)  # type: ignore[assignment]
        return tuple(sorted((_record(v.decode()) for v in raw.values()),
                            key=lambda k: (k.created_at, k.id)))

    def write(self, record: KeyRecord, *, new: bool) -> None:
        if self.read_only:
            raise StoreReadOnly("keys are read-only here (gateway.keys_read_only)")
        if new:
            if not self._redis.hsetnx(self._hash, record.id, _doc(record)):
                raise KeyConflict(f"key id {record.id!r} already exists; revoke it or choose "
                                  "another id")
        else:
            if not self._redis.hexists(self._hash, record.id):
                raise KeyNotFound(f"no key with id {record.id!r}")
            self._redis.hset(self._hash, record.id, _doc(record))
        self._redis.incr(self._ver)
        self._cache.refresh(force=True)

    def close(self) -> None:
        self._redis.close()


def open_key_store(gw: GatewayConfig, *, clock: Callable[[], float] = time.monotonic) -> KeyStore:
    """The store ``gateway.keys_store`` names (the config checked that its place is set)."""
    if gw.keys_store == "redis":
        assert gw.redis_url
        return RedisKeyStore(gw.redis_url, read_only=gw.keys_read_only, clock=clock)
    if gw.keys_store == "sqlite":
        assert gw.state_dir
        return SqliteKeyStore(Path(gw.state_dir) / "keys.sqlite", read_only=gw.keys_read_only,
                              clock=clock)
    return keys_file.KeyStore(Path(gw.keys_file), gw.keys_reload_interval_s, clock,
                              read_only=gw.keys_read_only)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Issued:
    """A key as created or rotated: its record and its secret, which exists nowhere else."""

    record: KeyRecord
    secret: str


# The fields an update may change (the id, digest, created_at and revoked are the store's own).
UPDATABLE = ("tier", "models", "tenant", "limits", "budget", "expires_at")


class KeyOps:
    """Create, rotate, revoke, update and read keys in one store: the admin API and the CLI."""

    def __init__(self, store: KeyStore) -> None:
        self.store = store

    def _validated(self, doc: dict[str, Any]) -> KeyRecord:
        try:
            return KeyRecord.model_validate(doc)
        except ValidationError as exc:
            raise KeyInvalid(format_validation_error(exc, "key")) from None

    def get(self, key_id: str) -> KeyRecord:
        for k in self.store.records():
            if k.id == key_id:
                return k
        raise KeyNotFound(f"no key with id {key_id!r}")

    def list(self) -> tuple[KeyRecord, ...]:
        return self.store.records()

    def create(self, key_id: str, **fields: Any) -> Issued:
        """A new key with a new secret; ``fields`` are any of ``UPDATABLE`` and ``role``."""
        secret = new_secret()
        doc = {k: v for k, v in fields.items() if v is not None}
        record = self._validated({**doc, "id": key_id, "digest": digest(secret), "created_at": _now()})
        self.store.write(record, new=True)
        return Issued(record, secret)

    def rotate(self, key_id: str) -> Issued:
        key = self.get(key_id)
        if key.revoked:
            raise KeyNotFound(f"no active key with id {key_id!r}")
        secret = new_secret()
        record = key.model_copy(update={"digest": digest(secret), "created_at": _now()})
        self.store.write(record, new=False)
        return Issued(record, secret)

    def revoke(self, key_id: str) -> KeyRecord:
        record = self.get(key_id).model_copy(update={"revoked": True})
        self.store.write(record, new=False)
        return record

    def update(self, key_id: str, changes: dict[str, Any]) -> KeyRecord:
        """Set the ``UPDATABLE`` fields in ``changes`` (None clears an optional one)."""
        unknown = sorted(set(changes) - set(UPDATABLE))
        if unknown:
            raise KeyInvalid(f"field {unknown[0]!r} cannot be changed; changeable: {', '.join(UPDATABLE)}")
        key = self.get(key_id)
        doc = key.model_dump()
        doc.update(changes)
        record = self._validated(doc)
        self.store.write(record, new=False)
        return record


def describe(record: KeyRecord) -> dict[str, Any]:
    """A key as the admin API shows it: every field but the digest."""
    return {"object": "api_key", **record.model_dump(mode="json", exclude={"digest"})}

