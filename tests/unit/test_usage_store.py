"""serve_app.state.usage's stores, and that the Redis-backed stores give their connections back when
the state closes (a gateway replica that shuts down must not leave clients open on a shared Redis)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from serve_app.state.connections import Connections
from serve_app.state.limits import Charge, RedisBackend
from serve_app.state.usage import MemoryUsageStore, RedisUsageStore, SqliteUsageStore, UsageStore


def _clients(url: str) -> int:
    with redis.Redis.from_url(url) as probe:
        return len(probe.client_list()) - 1  # not the probe itself


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis"])
def test_totals_add_up_per_key(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    async def main() -> tuple[dict[str, int], dict[str, int]]:
        conns = Connections(request.getfixturevalue("redis_url") if kind == "redis" else None,
                            tmp_path)
        store: UsageStore = (
            MemoryUsageStore() if kind == "memory"
            else SqliteUsageStore(conns.sqlite("usage.sqlite")) if kind == "sqlite"
            else RedisUsageStore(conns.redis(), prefix=f"test:{request.node.name}:"))
        try:
            await store.add("k1", {"requests": 1, "completion_tokens": 5})
            await store.add("k1", {"requests": 1, "completion_tokens": 7})
            return await store.get("k1"), await store.get("nobody")
        finally:
            await conns.close()

    assert asyncio.run(main()) == ({"requests": 2, "completion_tokens": 12}, {})


def test_sqlite_totals_outlive_the_connection(tmp_path: Path) -> None:
    """The embedded default's totals are durable: a new replica (new connection) reads them."""

    async def write_then_read() -> dict[str, int]:
        first = Connections(None, tmp_path)
        await SqliteUsageStore(first.sqlite("usage.sqlite")).add("k", {"requests": 3})
        await first.close()
        second = Connections(None, tmp_path)
        try:
            return await SqliteUsageStore(second.sqlite("usage.sqlite")).get("k")
        finally:
            await second.close()

    assert asyncio.run(write_then_read()) == {"requests": 3}


def test_closed_state_leaves_no_redis_connection_open(redis_url: str) -> None:
    before = _clients(redis_url)

    async def main() -> int:
        conns = Connections(redis_url, None)
        usage = RedisUsageStore(conns.redis(), prefix="test:close:")
        limits = RedisBackend(conns.redis(), prefix="test:close:")
        await asyncio.gather(usage.add("k", {"requests": 1}),
                             limits.admit([Charge("k:rpm", 1, 10)], 0.0))
        opened = _clients(redis_url)
        await conns.close()
        return opened

    assert asyncio.run(main()) >= before + 1
    assert _clients(redis_url) == before
