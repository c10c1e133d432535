"""The embedded default's demo key: one stable key that ``serve-app run`` prints, so that a user
can paste it into a shell once and keep it across restarts."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from serve_app.config import GatewayConfig
from serve_app.gateway.keys.ops import KeyOps
from serve_app.state.connections import Connections
from serve_app.state.keys import KeyStore, digest, open_key_store

DEMO_KEY_ID = "local-demo"


async def ensure_demo_key(store: KeyStore, secret_file: Path) -> str:
    """A stable local demo key in any key store: the stored secret while its digest is still
    active there; else a new secret for the demo key (created, or rotated back to active when
    its secret was lost or the key revoked), kept in ``secret_file``."""
    ops = KeyOps(store)
    keys = await ops.list()
    if secret_file.exists():
        secret = secret_file.read_text().strip()
        if any(k.digest == digest(secret) and not k.revoked for k in keys):
            return secret
    if any(k.id == DEMO_KEY_ID for k in keys):
        secret = (await ops.rotate(DEMO_KEY_ID, reactivate=True)).secret
    else:
        secret = (await ops.create(DEMO_KEY_ID, tier="standard")).secret
    _keep(secret_file, secret)
    return secret


def demo_key_in(gw: GatewayConfig, secret_file: Path) -> str:
    """``ensure_demo_key`` in the store ``gw`` names, for the launcher (which is not async)."""

    async def ensure() -> str:
        connections = Connections.of(gw.state)
        try:
            return await ensure_demo_key(open_key_store(gw.keys, connections), secret_file)
        finally:
            await connections.close()

    return asyncio.run(ensure())


def _keep(secret_file: Path, secret: str) -> None:
    secret_file.parent.mkdir(parents=True, exist_ok=True)
    secret_file.write_text(secret + "\n")
    os.chmod(secret_file, 0o600)
