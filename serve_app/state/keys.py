"""Key stores: where API keys live, and the copy in memory that answers every request.

A ``KeyStore`` holds ``KeyRecord``s (SHA-256 digests only, never a secret). Three backends:

- the YAML keys file (``FileKeyStore``): one host, editable by hand or Git; may be read-only;
- SQLite (``SqliteKeyStore``, ``<gateway.state.dir>/keys.sqlite``): one host, durable with nothing
  installed, shared by every gateway replica of the host through the file;
- Redis (``RedisKeyStore``, one hash at ``gateway.state.redis_url``): a cluster.

A request's key is looked up in memory (``lookup``, ``by_id``: no I/O on the request path). The
memory follows the store through ``refresh``, which asks for the store's version (the file's
stamp, a counter that every database write bumps) at most every ``interval_s`` and reloads on a
change; ``keep_fresh`` calls it in a replica's background, so a created key answers on every
replica within about the interval and a revoked one stops as fast. ``records``, ``write`` and the
poll never block the event loop: SQLite and the file run in threads, Redis is the state's one
async client. The operations on keys (create, rotate, revoke, update) are
``serve_app.gateway.keys.ops.KeyOps``, over any of these stores.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import hmac
import logging
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import yaml
from pydantic import ValidationError

from serve_app.config import KeyRecord, KeysConfig, KeysFile, format_validation_error
from serve_app.state.connections import Connections, SqliteFile

if TYPE_CHECKING:
    import redis.asyncio

logger = logging.getLogger("ray.serve")

POLL_S = 0.25  # how often a replica asks a database store whether keys changed (one cheap read)
SQLITE_FILE = "keys.sqlite"  # in gateway.state.dir
REDIS_PREFIX = "serve-app:keys"  # the hash; its version counter is REDIS_PREFIX + ":version"


class KeysFileError(ValueError):
    """The key store cannot be read or validated (the base of every key store error)."""


class KeyNotFound(KeysFileError):
    """No key with that id in the store."""


class KeyConflict(KeysFileError):
    """A key with that id exists already."""


class KeyInvalid(KeysFileError):
    """A key's fields do not validate (the message names the field and value)."""


class StoreReadOnly(KeysFileError):
    """The store is declared read-only (``gateway.keys.read_only``): keys change elsewhere."""


def digest(secret: str) -> str:
    """How a secret is stored and looked up: ``sha256:<hex>`` (the secret itself never is)."""
    return "sha256:" + hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def same_digest(a: str, b: str) -> bool:
    """Digests compared in constant time."""
    return hmac.compare_digest(a.encode(), b.encode())


# A read-modify-write of one key: the key as stored now -> the key to store (or raise to refuse).
Change = Callable[[KeyRecord], KeyRecord]


class KeyStore(Protocol):
    """Where keys live. ``lookup`` and ``by_id`` run on the request path and answer from memory;
    ``refresh`` brings the memory up to date with the store (at most every ``interval_s`` unless
    ``force``); ``records`` and ``write`` read and change the store itself. ``write`` raises
    ``KeyConflict`` (a new id exists), ``KeyNotFound`` (replacing an unknown id) or
    ``StoreReadOnly``, and the memory holds the change when it returns. ``change`` is one atomic
    read-modify-write of a key, across processes (a rotation never undoes a revocation that lands
    between its read and its write); it raises ``KeyNotFound`` for an unknown id, or what ``fn``
    raises. The store does not own its connection (``Connections.close`` gives it back)."""

    read_only: bool
    interval_s: float

    @property
    def location(self) -> str: ...
    def lookup(self, secret: str) -> KeyRecord | None: ...
    def by_id(self, key_id: str) -> KeyRecord | None: ...
    async def refresh(self, force: bool = False) -> None: ...
    async def check_now(self) -> None: ...
    async def records(self) -> tuple[KeyRecord, ...]: ...
    async def write(self, record: KeyRecord, *, new: bool) -> None: ...
    async def change(self, key_id: str, fn: Change) -> KeyRecord: ...


class _Memory:
    """The active keys by digest, reloaded when ``version()`` changes (asked at most every
    ``interval_s``). A store that cannot be read keeps serving the keys it had. ``load`` may
    return None: keep the keys, but take the version as seen (a broken keys file is not re-read
    until it changes)."""

    def __init__(self, interval_s: float, clock: Callable[[], float],
                 version: Callable[[], Awaitable[Any]],
                 load: Callable[[], Awaitable[tuple[KeyRecord, ...] | None]]) -> None:
        self.interval_s = interval_s
        self._clock, self._version, self._load = clock, version, load
        self._by_digest: dict[str, KeyRecord] = {}
        self._seen: Any = object()
        self._checked = float("-inf")
        # Refreshes may overlap (the poll and a write's): the one started last wins.
        self._started = self._applied = 0
        self._check: asyncio.Future[None] | None = None  # the version check of unknown secrets

    def lookup(self, secret: str) -> KeyRecord | None:
        d = digest(secret)
        record = self._by_digest.get(d)
        if record is None or not same_digest(record.digest, d):
            return None
        return record

    def by_id(self, key_id: str) -> KeyRecord | None:
        return next((k for k in self._by_digest.values() if k.id == key_id), None)

    async def check_now(self) -> None:
        """Read the version now, whatever the interval (a secret the memory does not know: a key
        created a moment ago elsewhere must not be refused until the next poll). Concurrent
        callers share one check, so a flood of unknown secrets costs one read at a time."""
        if self._check is None or self._check.done():
            self._check = asyncio.ensure_future(self._refresh(False))
        await asyncio.shield(self._check)

    async def refresh(self, force: bool = False) -> None:
        if not force and self._clock() - self._checked < self.interval_s:
            return
        await self._refresh(force)

    async def _refresh(self, force: bool) -> None:
        self._checked = self._clock()
        self._started += 1
        ticket = self._started
        try:
            version = await self._version()
            if not force and version == self._seen:
                return
            records = await self._load()
        except Exception as exc:  # the keys it had keep serving; the next poll tries again
            logger.error("keys not reloaded: %s", exc.__class__.__name__)
            return
        if ticket < self._applied:
            return
        self._applied, self._seen = ticket, version
        if records is not None:
            self._by_digest = {k.digest: k for k in records if not k.revoked}


class _Remembered:
    """What every key store answers from its memory (``_Memory``): the request path's lookups,
    and the refresh that brings the memory up to date."""

    _memory: _Memory

    def lookup(self, secret: str) -> KeyRecord | None:
        return self._memory.lookup(secret)

    def by_id(self, key_id: str) -> KeyRecord | None:
        """The active (unrevoked) key with this id: work done later on a key's behalf (a batch's
        lines) is charged to it only while it stays active."""
        return self._memory.by_id(key_id)

    async def refresh(self, force: bool = False) -> None:
        await self._memory.refresh(force)

    async def check_now(self) -> None:
        await self._memory.check_now()


async def keep_fresh(store: KeyStore) -> None:
    """Refresh ``store`` every ``store.interval_s`` until cancelled: a replica's background task."""
    while True:
        await store.refresh()
        await asyncio.sleep(store.interval_s)


# ---- the YAML keys file ------------------------------------------------------------------------
def read_keys_file(path: Path) -> KeysFile:
    if not path.exists():
        return KeysFile()
    try:
        doc = yaml.safe_load(path.read_text()) or {}
        return KeysFile.model_validate(doc)
    except yaml.YAMLError as exc:
        raise KeysFileError(f"{path}: not valid YAML ({exc.__class__.__name__})") from None
    except ValidationError as exc:
        raise KeysFileError(f"{path}:\n{format_validation_error(exc, 'keys')}") from None


def write_keys_file(path: Path, keys: KeysFile) -> None:
    """Atomic replace, so a gateway reloading at the same moment sees the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"keys": [k.model_dump(exclude_none=True) for k in keys.keys]}
    for k in doc["keys"]:
        k["models"] = list(k["models"])
    fd, tmp = tempfile.mkstemp(prefix=".keys-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write("# API keys: SHA-256 digests only. Edit with `serve-app keys ...`.\n")
        yaml.safe_dump(doc, f, sort_keys=False)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


class FileKeyStore(_Remembered):
    """Keys in the YAML keys file; re-read when the file's stamp changes, so that gateways on one
    host (or a mounted Secret that the kubelet swaps) share it. ``clock`` is injected so that a
    test can step past the interval instead of sleeping it out."""

    def __init__(self, path: Path, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, *, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only
        self._edit = threading.Lock()  # one read-modify-write of the file at a time
        self._memory = _Memory(interval_s, clock, self._stamp, self._load)
        self.interval_s = interval_s

    @property
    def location(self) -> str:
        return str(self.path)

    def _stamp_sync(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    async def _stamp(self) -> tuple[int, int, int] | None:
        return await asyncio.to_thread(self._stamp_sync)

    def _load_sync(self) -> tuple[KeyRecord, ...] | None:
        try:
            keys = read_keys_file(self.path).keys
        except (KeysFileError, OSError) as exc:
            # Keep serving with the keys we had; a broken edit must not lock everyone out.
            logger.error("keys file not reloaded: %s", exc)
            return None
        if not self.path.exists():
            logger.warning("keys file %s does not exist: every request will get 401", self.path)
        else:
            logger.info("loaded %d active keys from %s", sum(not k.revoked for k in keys), self.path)
        return keys

    async def _load(self) -> tuple[KeyRecord, ...] | None:
        return await asyncio.to_thread(self._load_sync)

    async def records(self) -> tuple[KeyRecord, ...]:
        return (await asyncio.to_thread(read_keys_file, self.path)).keys

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """This process's lock and an ``flock`` on ``<keys file>.lock``: one read-modify-write of
        the file at a time across every process on the host (the CLI, each gateway replica)."""
        with self._edit:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT,
                         0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the flock

    def _change_sync(self, key_id: str, fn: Change) -> KeyRecord:
        with self._locked():
            keys = read_keys_file(self.path).keys
            current = next((k for k in keys if k.id == key_id), None)
            if current is None:
                raise KeyNotFound(f"no key with id {key_id!r}")
            record = fn(current)
            write_keys_file(self.path, KeysFile(keys=tuple(record if k.id == key_id else k
                                                           for k in keys)))
            return record

    async def change(self, key_id: str, fn: Change) -> KeyRecord:
        if self.read_only:
            raise StoreReadOnly("keys are read-only here (gateway.keys_read_only): change the keys "
                                "file where it is kept")
        record = await asyncio.to_thread(self._change_sync, key_id, fn)
        await self.refresh(force=True)
        return record

    def _write_sync(self, record: KeyRecord, new: bool) -> None:
        with self._locked():
            keys = read_keys_file(self.path).keys
            exists = any(k.id == record.id for k in keys)
            if new and exists:
                raise KeyConflict(f"key id {record.id!r} already exists; revoke it or choose "
                                  "another id")
            if not new and not exists:
                raise KeyNotFound(f"no key with id {record.id!r}")
            updated = (*keys, record) if new else tuple(record if k.id == record.id else k
                                                        for k in keys)
            write_keys_file(self.path, KeysFile(keys=updated))

    async def write(self, record: KeyRecord, *, new: bool) -> None:
        """Add ``record`` (``new``) or replace the key of its id, in one atomic file replace."""
        if self.read_only:
            raise StoreReadOnly("keys are read-only here (gateway.keys.read_only): change the keys "
                                "file where it is kept")
        await asyncio.to_thread(self._write_sync, record, new)
        await self.refresh(force=True)


# ---- the database stores -----------------------------------------------------------------------
def _record(doc: str) -> KeyRecord:
    return KeyRecord.model_validate_json(doc)


def _doc(record: KeyRecord) -> str:
    return record.model_dump_json(exclude_none=True)


class SqliteKeyStore(_Remembered):
    """Keys in a SQLite file (tables ``keys`` and ``meta``, whose ``version`` each write bumps):
    durable, and shared by the gateway replicas of a host. Every statement runs in the file's
    thread (``SqliteFile.run``/``write``)."""

    def __init__(self, file: SqliteFile, *, read_only: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._file = file
        self.read_only = read_only
        self.interval_s = POLL_S
        self._ready = False  # the tables are created on first use, in the file's thread
        self._memory = _Memory(POLL_S, clock, self._version, self.records)

    @property
    def location(self) -> str:
        return str(self._file.path)

    def _schema(self, db: sqlite3.Connection) -> None:
        if not self._ready:
            db.execute("CREATE TABLE IF NOT EXISTS keys (id TEXT PRIMARY KEY, doc TEXT NOT NULL)")
            db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER)")
            db.execute("INSERT OR IGNORE INTO meta VALUES ('version', 0)")
            self._ready = True

    async def _version(self) -> int:
        def version(db: sqlite3.Connection) -> int:
            self._schema(db)
            return int(db.execute("SELECT value FROM meta WHERE name = 'version'").fetchone()[0])

        return await self._file.run(version)

    async def records(self) -> tuple[KeyRecord, ...]:
        def rows(db: sqlite3.Connection) -> list[Any]:
            self._schema(db)
            return db.execute("SELECT doc FROM keys ORDER BY rowid").fetchall()

        return tuple(_record(r[0]) for r in await self._file.run(rows))

    async def write(self, record: KeyRecord, *, new: bool) -> None:
        if self.read_only:
            raise StoreReadOnly("keys are read-only here (gateway.keys.read_only)")

        def write(db: sqlite3.Connection) -> None:
            self._schema(db)
            exists = db.execute("SELECT 1 FROM keys WHERE id = ?", (record.id,)).fetchone()
            if new and exists:
                raise KeyConflict(f"key id {record.id!r} already exists; revoke it or choose "
                                  "another id")
            if not new and not exists:
                raise KeyNotFound(f"no key with id {record.id!r}")
            db.execute("INSERT OR REPLACE INTO keys VALUES (?, ?)", (record.id, _doc(record)))
            db.execute("UPDATE meta SET value = value + 1 WHERE name = 'version'")

        await self._file.write(write)
        await self.refresh(force=True)

    async def change(self, key_id: str, fn: Change) -> KeyRecord:
        if self.read_only:
            raise StoreReadOnly("keys are read-only here (gateway.keys_read_only)")

        def change(db: sqlite3.Connection) -> KeyRecord:  # inside BEGIN IMMEDIATE: one writer
            self._schema(db)
            row = db.execute("SELECT doc FROM keys WHERE id = ?", (key_id,)).fetchone()
            if row is None:
                raise KeyNotFound(f"no key with id {key_id!r}")
            record = fn(_record(row[0]))
            db.execute("UPDATE keys SET doc = ? WHERE id = ?", (_doc(record), key_id))
            db.execute("UPDATE meta SET value = value + 1 WHERE name = 'version'")
            return record

        record = await self._file.write(change)
        await self.refresh(force=True)
        return record


class RedisKeyStore(_Remembered):
    """Keys in one Redis hash (id -> record JSON) and a version counter: every gateway replica of
    a cluster sees a change within ``POLL_S``. Only the poll (one GET) and admin writes reach
    Redis, through the state's one async client."""

    def __init__(self, client: redis.asyncio.Redis, *, read_only: bool = False,
                 prefix: str = REDIS_PREFIX, clock: Callable[[], float] = time.monotonic) -> None:
        self._redis = client
        self._hash, self._ver = prefix, prefix + ":version"
        self.read_only = read_only
        self.interval_s = POLL_S
        self._memory = _Memory(POLL_S, clock, self._version, self.records)

    @property
    def location(self) -> str:
        return f"redis hash {self._hash}"

    async def _version(self) -> Any:
        return await self._redis.get(self._ver)

    async def records(self) -> tuple[KeyRecord, ...]:
        raw: dict[bytes | str, bytes | str] = await self._redis.hgetall(self._hash)
        docs = (v.decode() if isinstance(v, bytes) else v for v in raw.values())
        return tuple(sorted((_record(d) for d in docs), key=lambda k: (k.created_at, k.id)))

    async def write(self, record: KeyRecord, *, new: bool) -> None:
        if self.read_only:
            raise StoreReadOnly("keys are read-only here (gateway.keys.read_only)")
        if new:
            if not await self._redis.hsetnx(self._hash, record.id, _doc(record)):
                raise KeyConflict(f"key id {record.id!r} already exists; revoke it or choose "
                                  "another id")
        else:
            if not await self._redis.hexists(self._hash, record.id):
                raise KeyNotFound(f"no key with id {record.id!r}")
            await self._redis.hset(self._hash, record.id, _doc(record))
        await self._redis.incr(self._ver)
        await self.refresh(force=True)

    async def change(self, key_id: str, fn: Change) -> KeyRecord:
        """WATCH the hash, read, MULTI/EXEC the write: a write by anyone else in between makes
        EXEC fail, and the change is read and applied again."""
        from redis.exceptions import WatchError

        if self.read_only:
            raise StoreReadOnly("keys are read-only here (gateway.keys_read_only)")
        while True:
            async with self._redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(self._hash)
                    doc = await pipe.hget(self._hash, key_id)
                    if doc is None:
                        raise KeyNotFound(f"no key with id {key_id!r}")
                    record = fn(_record(doc.decode() if isinstance(doc, bytes) else doc))
                    pipe.multi()  # type: ignore[no-untyped-call]
                    pipe.hset(self._hash, key_id, _doc(record))
                    pipe.incr(self._ver)
                    await pipe.execute()
                except WatchError:
                    continue
            await self.refresh(force=True)
            return record


def open_key_store(keys: KeysConfig, connections: Connections, *,
                   clock: Callable[[], float] = time.monotonic) -> KeyStore:
    """The store ``gateway.keys.store`` names, on ``connections`` (``Connections.of(gateway.state)``:
    the config checked that the store's place is set there). Nothing is read yet:
    ``await store.refresh(force=True)`` loads the keys."""
    if keys.store == "redis":
        return RedisKeyStore(connections.redis(), read_only=keys.read_only, clock=clock)
    if keys.store == "sqlite":  # in the state dir
        return SqliteKeyStore(connections.sqlite(SQLITE_FILE), read_only=keys.read_only, clock=clock)
    return FileKeyStore(Path(keys.file), keys.reload_interval_s, clock, read_only=keys.read_only)
