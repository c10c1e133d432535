"""Secrets that every gateway replica must share and that no operator has to make: made once, at
random, and kept where the replicas' state is (the console's session key, ``gateway.console``).

Redis (``gateway.state.redis_url``) when the replicas share one: ``SET NX`` under
``serve-app:secret:<name>``, so the first replica's value wins and the others read it. Else the
file ``<gateway.state.dir>/<name>.secret``, created ``0600`` with ``O_EXCL`` (one host's replicas
race safely). With neither, None: the caller decides what a secret of this process alone is worth.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path

from serve_app.state.connections import Connections

REDIS_PREFIX = "serve-app:secret:"
SECRET_BYTES = 32


def _file_secret(path: Path) -> bytes:
    """The secret in ``path``, made (mode 0600) if there is none yet."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = secrets.token_hex(SECRET_BYTES).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        try:
            os.write(fd, fresh)
        finally:
            os.close(fd)
    value = path.read_bytes().strip()
    if len(value) < SECRET_BYTES:  # an empty or cut file (a crash mid-write): never a weak key
        raise ValueError(f"{path.name} holds no usable secret; delete it to make a new one")
    return value


async def shared_secret(connections: Connections, name: str) -> bytes | None:
    """The secret ``name`` every replica sharing these connections reads, made on first use."""
    if connections.redis_url:
        client = connections.redis()
        key = REDIS_PREFIX + name
        await client.set(key, secrets.token_hex(SECRET_BYTES), nx=True)
        value = await client.get(key)
        return value if isinstance(value, bytes) else str(value).encode()
    if connections.state_dir is not None:
        return await asyncio.to_thread(_file_secret, connections.state_dir / f"{name}.secret")
    return None
