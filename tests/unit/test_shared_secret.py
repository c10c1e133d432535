"""The secret every gateway replica shares (``state/secrets.py``) on a real redis-server (the
``redis_url`` fixture): the first replica's value wins, every other replica reads it, and the
console's sessions signed by one replica verify on another."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from serve_app.gateway.http.console_session import COOKIE, Signer
from serve_app.state.connections import Connections
from serve_app.state.secrets import REDIS_PREFIX, SECRET_BYTES, shared_secret
from tests.keys import run
from tests.unit.console_client import Console
from tests.unit.test_admin_api import Admin


@pytest.fixture
def sync_redis(redis_url: str) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_url) as client:
        yield client


def _read(conns: Connections, name: str) -> bytes | None:
    async def go() -> bytes | None:
        try:
            return await shared_secret(conns, name)
        finally:
            await conns.close()
    return run(go())


def test_replicas_over_one_redis_read_the_same_secret(redis_url: str, sync_redis: redis.Redis,
                                                       tmp_path: Path) -> None:
    name = f"t-{uuid.uuid4().hex[:8]}"
    first = _read(Connections(redis_url, tmp_path / "a"), name)
    second = _read(Connections(redis_url, tmp_path / "b"), name)
    assert first is not None and len(first) >= SECRET_BYTES
    assert first == second
    assert sync_redis.get(REDIS_PREFIX + name) == first
    # Redis comes first: no file is made in either replica's state dir
    assert not (tmp_path / "a" / f"{name}.secret").exists()
    assert not (tmp_path / "b" / f"{name}.secret").exists()


def test_the_value_already_in_redis_wins(redis_url: str, sync_redis: redis.Redis) -> None:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kept = b"k" * (2 * SECRET_BYTES)
    sync_redis.set(REDIS_PREFIX + name, kept)
    assert _read(Connections(redis_url, None), name) == kept  # SET NX did not overwrite it


def test_a_console_session_is_signed_with_the_redis_secret(redis_url: str, sync_redis: redis.Redis,
                                                            tmp_path: Path) -> None:
    """The console of a gateway with ``gateway.state.redis_url`` signs with the secret in Redis:
    a replica that reads it (another process, here a ``Signer`` over it) accepts the cookie."""
    a = Admin(tmp_path, gateway={"state": {"dir": str(tmp_path / "state"), "redis_url": redis_url}})
    with a.client:
        c = Console(a)
        assert c.signin(a.admin).status_code == 303
        cookie = c.cookie
        assert cookie is not None and c.get("/console/keys").status_code == 200
        # the replica's lifespan closes its state; this app has none: close it on the app's loop
        state: Any = getattr(a.deps.secrets, "__self__", None)  # the State whose method it is
        assert a.client.portal is not None and state is not None
        a.client.portal.call(state.close)
    stored = sync_redis.get(REDIS_PREFIX + "console")
    assert isinstance(stored, bytes) and len(stored) >= SECRET_BYTES
    assert not (tmp_path / "state" / "console.secret").exists()
    other = Signer(stored, 3600)
    session = other.read(cookie)
    assert session is not None and session.key_id == "root"
    assert Signer(b"x" * 64, 3600).read(cookie) is None  # and only that secret verifies it
    assert COOKIE == "serve_app_console"
