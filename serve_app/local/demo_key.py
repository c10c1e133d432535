"""The embedded default's demo key: one stable key that ``serve-app run`` prints, so that a user
can paste it into a shell once and keep it across restarts."""

from __future__ import annotations

import os
from pathlib import Path

from serve_app.gateway.auth import digest
from serve_app.gateway.keys import create_key, read_keys_file, revoke_key, write_keys_file

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
    secret_file.parent.mkdir(parents=True, exist_ok=True)
    secret_file.write_text(secret + "\n")
    os.chmod(secret_file, 0o600)
    return secret
