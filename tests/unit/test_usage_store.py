"""serve_app.gateway.accounting.usage's stores, and that the Redis-backed ones give their connections back on
close (a gateway replica that shuts down must not leave clients open on a shared Redis)."""

from __future__ import annotations

import asyncio

import pytest
import redis

from serve_app.gateway.accounting.usage import MemoryUsageStore, RedisUsageStore, UsageStore
from serve_app.gateway.admission.limits import Charge, RedisBackend


def _clients(url: str) -> int:
    with redis.Redis.from_url(url) as probe:
        return len(probe.client_list()) - 1  # not the probe itself


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_totals_add_up_per_key(kind: str, request: pytest.FixtureRequest) -> None:
    async def main() -> tuple[dict[str, int], dict[str, int]]:
        store: UsageStore = (MemoryUsageStore() if kind == "memory" else
                             RedisUsageStore(request.getfixturevalue("redis_url"),
                                             prefix=f"test:{request.node.name}:"))
        try:
            await store.add("k1", {"requests": 1, "completion_tokens": 5})
            await store.add("k1", {"requests": 1, "completion_tokens": 7})
            return await store.get("k1"), await store.get("nobody")
        finally:
            await store.close()

    assert asyncio.run(main()) == ({"requests": 2, "completion_tokens": 12}, {})


def test_closed_redis_stores_leave_no_connection_open(redis_url: str) -> None:
    before = _clients(redis_url)

    async def main() -> int:
        usage = RedisUsageStore(redis_url, prefix="test:close:")
        limits = RedisBackend(redis_url, prefix="test:close:")
        await usage.add("k", {"requests": 1})
        await limits.admit([Charge("k:rpm", 1, 10)], 0.0)
        opened = _clients(redis_url)
        await usage.close()
        await limits.close()
        return opened

    assert asyncio.run(main()) >= before + 2
    assert _clients(redis_url) == before
