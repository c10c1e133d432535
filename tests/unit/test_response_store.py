"""The stored-responses stores (serve_app/state/responses.py), each backend against the same
contract: documents with an expiry, background events in order after an index, cancel requests,
and delete dropping all three. Redis is a real redis-server (tests/conftest.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from serve_app.state.connections import SqliteFile
from serve_app.state.responses import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseDocs,
    SqliteResponseStore,
    valid_response_id,
)
from tests.unit.fakes import StepClock


def _contract(store: ResponseDocs, expire: Callable[[], None] | None) -> None:
    asyncio.run(_check(store, expire))


async def _check(store: ResponseDocs, expire: Callable[[], None] | None) -> None:
    assert await store.get("resp_1") is None
    await store.put("resp_1", b'{"v":1}', 60)
    await store.put("resp_1", b'{"v":2}', 60)
    assert await store.get("resp_1") == b'{"v":2}'
    await store.append("resp_1", [b"e0", b"e1"], 60)
    await store.append("resp_1", [b"e2"], 60)
    assert await store.events("resp_1", -1) == [b"e0", b"e1", b"e2"]
    assert await store.events("resp_1", 1) == [b"e2"]
    assert await store.events("resp_1", 2) == []
    assert await store.event_count("resp_1") == 3 and await store.event_count("resp_2") == 0
    assert not await store.cancel_requested("resp_1")
    await store.request_cancel("resp_1", 60)
    assert await store.cancel_requested("resp_1")
    assert await store.delete("resp_1") is True
    assert await store.get("resp_1") is None and await store.events("resp_1", -1) == []
    assert await store.event_count("resp_1") == 0
    assert not await store.cancel_requested("resp_1")
    assert await store.delete("resp_1") is False
    if expire is not None:
        await store.put("resp_2", b"{}", 1)
        expire()
        if isinstance(store, RedisResponseStore):
            await asyncio.sleep(1.2)
        assert await store.get("resp_2") is None


def test_memory_store() -> None:
    clock = StepClock()
    _contract(MemoryResponseStore(clock), lambda: clock.step(2))


def test_sqlite_store(tmp_path: Path) -> None:
    clock = StepClock()
    f = SqliteFile(tmp_path / "responses.sqlite")
    _contract(SqliteResponseStore(f, clock), lambda: clock.step(2))
    # Durable: a new connection (a restarted gateway) reads what the first wrote.
    asyncio.run(SqliteResponseStore(f, clock).put("resp_3", b"{}", 60))
    f.close()
    again = SqliteResponseStore(SqliteFile(tmp_path / "responses.sqlite"), clock)
    assert asyncio.run(again.get("resp_3")) == b"{}"


def test_redis_store(redis_url: str) -> None:
    async def go() -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            await _check(RedisResponseStore(client, prefix="test:resp:"), lambda: None)
        finally:
            await client.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("rid", ["resp_", "x_1", "resp_../a", "resp_*", "resp_" + "a" * 80, ""])
def test_ids_that_are_not_the_gateways_are_refused(rid: str) -> None:
    assert not valid_response_id(rid)
