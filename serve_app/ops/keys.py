"""``serve-app keys``: create, list, rotate and revoke API keys in a keys file (the keys file
itself, and each operation on it, belong to serve_app/gateway/keys.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from serve_app.gateway.keys import KeysFileError, create_key, read_keys_file, revoke_key, rotate_key
from serve_app.ops.configfile import load_config


def keys_path(keys_file: str | None, config: str) -> Path:
    """``keys_file`` if given, else the config's ``gateway.keys_file``."""
    return Path(keys_file) if keys_file else Path(load_config(config).gateway.keys_file)


def run(command: str, path: Path, key_id: str = "", *, tier: str = "standard", models: str = "*",
        tenant: str | None = None, limits: dict[str, int] | None = None) -> int:
    """Do ``command`` (create, rotate, list or revoke) on ``path`` and print the outcome; a new
    secret is printed once, as the last line. A keys file error is a message and exit code 2."""
    try:
        if command == "create":
            model_list = [m for m in (models or "*").split(",") if m]
            secret = create_key(path, key_id, tier, model_list, tenant=tenant, limits=limits or {})
            print(f"created key {key_id!r} (tier {tier}, models {','.join(model_list)}) in {path}")
            print("secret (shown once, store it now):")
            print(secret)
        elif command == "rotate":
            secret = rotate_key(path, key_id)
            print(f"rotated key {key_id!r} in {path}; the old secret stops working within seconds")
            print("new secret (shown once, store it now):")
            print(secret)
        elif command == "list":
            _list(path)
        elif command == "revoke":
            revoke_key(path, key_id)
            print(f"revoked key {key_id!r} in {path}")
    except KeysFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _list(path: Path) -> None:
    keys = read_keys_file(path).keys
    if not keys:
        print(f"no keys in {path}")
    for k in keys:
        state = "revoked" if k.revoked else "active"
        extra = f" limits={k.limits.model_dump(exclude_none=True)}" if k.limits else ""
        print(f"{k.id:24} {k.tier:10} {state:8} {','.join(k.models):24} {k.created_at}{extra}")
