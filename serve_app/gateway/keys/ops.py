"""The one set of key operations: create, rotate, revoke, update and read keys in any key store
(``serve_app.state.keys``: the YAML file, SQLite or Redis). The admin API, ``serve-app keys``, the
launcher's demo key and the tests all change keys through ``KeyOps``; a secret is made here
(``auth.new_secret``), returned once, and stored only as its digest.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from serve_app.config import KeyRecord, format_validation_error
from serve_app.gateway.keys.auth import new_secret
from serve_app.state.keys import KeyInvalid, KeyNotFound, KeyStore, digest


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
    """Create, rotate, revoke, update and read keys in one store. A create is one ``store.write``;
    a rotate, revoke or update is one ``store.change``, an atomic read-modify-write across
    processes (a rotation never undoes a revocation that lands between its read and its write).
    The store's memory holds a change when it returns (other replicas within their poll). Store errors (``KeyNotFound``, ``KeyConflict``, ``KeyInvalid``, ``StoreReadOnly``) pass
    through for the caller to show."""

    def __init__(self, store: KeyStore) -> None:
        self.store = store

    def _validated(self, doc: dict[str, Any]) -> KeyRecord:
        try:
            return KeyRecord.model_validate(doc)
        except ValidationError as exc:
            raise KeyInvalid(format_validation_error(exc, "key")) from None

    async def get(self, key_id: str) -> KeyRecord:
        for k in await self.store.records():
            if k.id == key_id:
                return k
        raise KeyNotFound(f"no key with id {key_id!r}")

    async def list(self) -> tuple[KeyRecord, ...]:
        return await self.store.records()

    async def create(self, key_id: str, **fields: Any) -> Issued:
        """A new key with a new secret; ``fields`` are any of ``UPDATABLE`` and ``role``."""
        secret = new_secret()
        doc = {k: v for k, v in fields.items() if v is not None}
        record = self._validated({**doc, "id": key_id, "digest": digest(secret), "created_at": _now()})
        await self.store.write(record, new=True)
        return Issued(record, secret)

    async def rotate(self, key_id: str, *, reactivate: bool = False) -> Issued:
        """A new secret for the key; the old one stops. A revoked key is refused, unless
        ``reactivate`` (the launcher's demo key, whose secret was lost or whose key was revoked,
        comes back under its id with a new secret)."""
        secret = new_secret()

        def rotated(key: KeyRecord) -> KeyRecord:
            if key.revoked and not reactivate:
                raise KeyNotFound(f"no active key with id {key_id!r}")
            return key.model_copy(update={"digest": digest(secret), "created_at": _now(),
                                          "revoked": False})

        return Issued(await self.store.change(key_id, rotated), secret)

    async def revoke(self, key_id: str) -> KeyRecord:
        return await self.store.change(
            key_id, lambda key: key.model_copy(update={"revoked": True}))

    async def update(self, key_id: str, changes: dict[str, Any]) -> KeyRecord:
        """Set the ``UPDATABLE`` fields in ``changes`` (None clears an optional one)."""
        unknown = sorted(set(changes) - set(UPDATABLE))
        if unknown:
            raise KeyInvalid(f"field {unknown[0]!r} cannot be changed; changeable: {', '.join(UPDATABLE)}")
        def updated(key: KeyRecord) -> KeyRecord:
            return self._validated({**key.model_dump(), **changes})

        return await self.store.change(key_id, updated)


def describe(record: KeyRecord) -> dict[str, Any]:
    """A key as the admin API shows it: every field but the digest."""
    return {"object": "api_key", **record.model_dump(mode="json", exclude={"digest"})}

