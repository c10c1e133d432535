"""The embedded default's demo key: one stable key that ``serve-app run`` prints, so that a user
can paste it into a shell once and keep it across restarts."""

from __future__ import annotations

import os
from pathlib import Path

from serve_app.gateway.keys.auth import digest, new_secret
from serve_app.gateway.keys.keyfile import create_key, read_keys_file, revoke_key, write_keys_file
from serve_app.gateway.keys.store import KeyOps, KeyStore

DEMO_KEY_ID = "local-demo"


def ensure_demo_key(keys_file: Path, secret_file: Path) -> str:
    """A stable local demo key: reuse the stored secret while its digest is still active."""
    keys = read_keys_file(keys_file)
    active = {k.digest for k in keys.keys if not k.revoked}
    if secret_file.exists():
        secret = secret_file.read_text().strip()
        if digest(secret) in active:
            return secret
    if any(k.id == DEMO_KEY_ID for k in keys.keys):
        revoke_key(keys_file, DEMO_KEY_ID)
        keys = read_keys_file(keys_file)
        write_keys_file(keys_file, type(keys)(keys=tuple(k for k in keys.keys if k.id != DEMO_KEY_ID)))
    secret = create_key(keys_file, DEMO_KEY_ID, "standard", ["*"])
    _keep(secret_file, secret)
    return secret


def ensure_demo_key_in(store: KeyStore, secret_file: Path) -> str:
    """The same stable demo key in a SQLite or Redis key store (``gateway.keys_store``)."""
    if secret_file.exists():
        secret = secret_file.read_text().strip()
        if store.lookup(secret) is not None:
            return secret
    existing = [k for k in store.records() if k.id == DEMO_KEY_ID]
    if not existing:
        secret = KeyOps(store).create(DEMO_KEY_ID, tier="standard").secret
    else:  # lost secret, or revoked: the same id with a new secret
        secret = new_secret()
        store.write(existing[0].model_copy(update={"digest": digest(secret), "revoked": False}),
                    new=False)
    _keep(secret_file, secret)
    return secret


def _keep(secret_file: Path, secret: str) -> None:
    secret_file.parent.mkdir(parents=True, exist_ok=True)
    secret_file.write_text(secret + "\n")
    os.chmod(secret_file, 0o600)
