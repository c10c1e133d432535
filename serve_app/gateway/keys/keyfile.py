"""The keys file: load, look up by digest, hot-reload, and the edits the console script makes."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import yaml
from pydantic import ValidationError

from serve_app.config import KeyRecord, KeysFile, format_validation_error
from serve_app.gateway.keys.auth import digest, new_secret, same_digest

logger = logging.getLogger(__name__)


class KeysFileError(ValueError):
    """The keys file exists but cannot be parsed or validated (the base of every key store error)."""


class KeyNotFound(KeysFileError):
    """No key with that id in the store."""


class KeyConflict(KeysFileError):
    """A key with that id exists already."""


class KeyInvalid(KeysFileError):
    """A key's fields do not validate (the message names the field and value)."""


class StoreReadOnly(KeysFileError):
    """The store is declared read-only (``gateway.keys_read_only``): keys change elsewhere."""


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


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def create_key(
    path: Path,
    key_id: str,
    tier: str,
    models: list[str],
    *,
    tenant: str | None = None,
    limits: dict[str, int] | None = None,
) -> str:
    """Add a key and return its secret, which exists nowhere else afterwards."""
    keys = read_keys_file(path)
    if any(k.id == key_id for k in keys.keys):
        raise KeysFileError(f"key id {key_id!r} already exists; revoke it or choose another id")
    secret = new_secret()
    try:
        record = KeyRecord.model_validate(
            {
                "id": key_id,
                "digest": digest(secret),
                "tier": tier,
                "models": tuple(models) or ("*",),
                "created_at": _now(),
                "tenant": tenant,
                "limits": limits or None,
            }
        )
    except ValidationError as exc:
        raise KeysFileError(format_validation_error(exc, "key")) from None
    write_keys_file(path, KeysFile(keys=(*keys.keys, record)))
    return secret


def rotate_key(path: Path, key_id: str) -> str:
    """Give a key a new secret: the new one works and the old one stops, as soon as gateways reload."""
    keys = read_keys_file(path)
    if not any(k.id == key_id and not k.revoked for k in keys.keys):
        raise KeysFileError(f"no active key with id {key_id!r} in {path}")
    secret = new_secret()
    updated = tuple(
        k.model_copy(update={"digest": digest(secret), "created_at": _now()}) if k.id == key_id else k
        for k in keys.keys
    )
    write_keys_file(path, KeysFile(keys=updated))
    return secret


def revoke_key(path: Path, key_id: str) -> None:
    keys = read_keys_file(path)
    if not any(k.id == key_id for k in keys.keys):
        raise KeysFileError(f"no key with id {key_id!r} in {path}")
    updated = tuple(
        k.model_copy(update={"revoked": True}) if k.id == key_id else k for k in keys.keys
    )
    write_keys_file(path, KeysFile(keys=updated))


class KeyStore:
    """The YAML file's key store (``keystore.KeyStore``): looks keys up by digest and re-reads the
    file when it changes (checked at most every interval). Gateways on one host share the file.

    ``clock`` is injected so that a test can step past the interval instead of sleeping it out."""

    def __init__(self, path: Path, reload_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, *, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only
        self.reload_interval_s = reload_interval_s
        self.clock = clock
        self._by_digest: dict[str, KeyRecord] = {}
        self._stamp: tuple[int, int, int] | None = None
        self._lock = threading.Lock()
        self._reload(force=True)
        self._checked = clock()

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _reload(self, force: bool = False) -> None:
        stamp = self._file_stamp()
        if not force and stamp == self._stamp:
            return
        try:
            keys = read_keys_file(self.path)
        except (KeysFileError, OSError) as exc:
            # Keep serving with the keys we had; a broken edit must not lock everyone out.
            logger.error("keys file not reloaded: %s", exc)
            self._stamp = stamp
            return
        self._by_digest = {k.digest: k for k in keys.keys if not k.revoked}
        self._stamp = stamp
        if stamp is None:
            logger.warning("keys file %s does not exist: every request will get 401", self.path)
        else:
            logger.info("loaded %d active keys from %s", len(self._by_digest), self.path)

    def maybe_reload(self) -> None:
        if self.clock() - self._checked < self.reload_interval_s:
            return
        with self._lock:
            # Another caller may have reloaded while this one waited for the lock. The stamp is
            # only advanced after the reload, so nobody skips ahead with the old keys.
            if self.clock() - self._checked < self.reload_interval_s:
                return
            self._reload()
            self._checked = self.clock()

    def lookup(self, secret: str) -> KeyRecord | None:
        self.maybe_reload()
        d = digest(secret)
        record = self._by_digest.get(d)
        if record is None or not same_digest(record.digest, d):
            return None
        return record

    def by_id(self, key_id: str) -> KeyRecord | None:
        """The active (unrevoked) key with this id: work done later on a key's behalf (a batch's
        lines) is charged to it only while it stays active."""
        self.maybe_reload()
        return next((k for k in self._by_digest.values() if k.id == key_id), None)

    @property
    def location(self) -> str:
        return str(self.path)

    def records(self) -> tuple[KeyRecord, ...]:
        return read_keys_file(self.path).keys

    def write(self, record: KeyRecord, *, new: bool) -> None:
        """Add ``record`` (``new``) or replace the key of its id, in one atomic file replace."""
        if self.read_only:
            raise StoreReadOnly("keys are read-only here (gateway.keys_read_only): change the keys "
                                "file where it is kept")
        keys = read_keys_file(self.path).keys
        exists = any(k.id == record.id for k in keys)
        if new and exists:
            raise KeyConflict(f"key id {record.id!r} already exists; revoke it or choose another id")
        if not new and not exists:
            raise KeyNotFound(f"no key with id {record.id!r}")
        updated = (*keys, record) if new else tuple(record if k.id == record.id else k for k in keys)
        write_keys_file(self.path, KeysFile(keys=updated))
        with self._lock:
            self._reload(force=True)

    def close(self) -> None:
        return None
