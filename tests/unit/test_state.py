"""serve_app.state: ``open_state`` opens one Redis client and one SQLite connection per file for all
the stores of a replica, closes them once, and never runs SQLite on the event loop's thread."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
import redis

from serve_app.config import AppConfig
from serve_app.state import open_state
from serve_app.state.batches import FileBatchStore, RedisBatchStore
from serve_app.state.budgets import Counter, MemoryBudgets, RedisBudgets, SqliteBudgets
from serve_app.state.connections import Connections
from serve_app.state.limits import Charge, MemoryBackend, RedisBackend
from serve_app.state.usage import MemoryUsageStore, RedisUsageStore, SqliteUsageStore


def _cfg(tmp_path: Path, **state: Any) -> AppConfig:
    return AppConfig.model_validate({
        "models": [{"id": "tiny-chat", "source": "builtin:tiny-chat"}],
        "gateway": {"keys": {"file": str(tmp_path / "keys.yaml")}, "state": state},
    })


def _clients(url: str) -> int:
    with redis.Redis.from_url(url) as probe:
        return len(probe.client_list()) - 1  # not the probe itself


def test_the_embedded_default_is_durable_on_one_sqlite_connection(tmp_path: Path) -> None:
    """Without Redis, usage and budgets go to ``<gateway.state.dir>/usage.sqlite`` over one connection, the
    audit trail to ``<gateway.state.dir>/audit.log``; batches and files to the files folder beside the keys
    file; limits stay in memory."""
    state = open_state(_cfg(tmp_path, dir=str(tmp_path / "state")))
    assert isinstance(state.usage, SqliteUsageStore) and isinstance(state.budgets, SqliteBudgets)
    assert isinstance(state.limits, MemoryBackend) and isinstance(state.batches, FileBatchStore)
    assert state.usage._file is state.budgets._file  # one SqliteFile for the two
    assert state.usage._file.path == (tmp_path / "state" / "usage.sqlite").resolve()
    assert state.files.dir == (tmp_path / "batch" / "files").resolve()
    assert state.audit is not None and state.audit.path == tmp_path / "state" / "audit.log"

    async def use() -> list[int]:
        await state.usage.add("k", {"requests": 1})
        await state.budgets.add(["key:k:day:2026-12-06"], 5)
        got = await state.budgets.get(["key:k:day:2026-12-06"])
        await state.close()
        await state.close()  # idempotent
        return got

    assert asyncio.run(use()) == [5]
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):  # closed with the state
        state.usage._file.db.execute("SELECT 1")
    with sqlite3.connect(tmp_path / "state" / "usage.sqlite") as db:  # the same tables as before
        assert db.execute("SELECT value FROM usage WHERE key_id = 'k'").fetchone() == (1,)
        assert db.execute("SELECT spent FROM budget").fetchone() == (5,)


def test_without_redis_or_state_dir_the_stores_are_in_memory(tmp_path: Path) -> None:
    state = open_state(_cfg(tmp_path))
    assert isinstance(state.usage, MemoryUsageStore) and isinstance(state.budgets, MemoryBudgets)
    assert state.audit is None
    asyncio.run(state.close())


def test_one_redis_client_for_every_store(redis_url: str, tmp_path: Path) -> None:
    """Usage, budgets, limits and batches share one client (one pool); closing the state gives
    every connection back, and closing it again does nothing."""
    before = _clients(redis_url)
    state = open_state(_cfg(tmp_path, redis_url=redis_url, limits_store="redis"))
    assert isinstance(state.usage, RedisUsageStore) and isinstance(state.budgets, RedisBudgets)
    assert isinstance(state.limits, RedisBackend) and isinstance(state.batches, RedisBatchStore)
    client = state.connections.redis()
    assert client is state.connections.redis()
    assert state.usage._redis is client and state.budgets._redis is client
    assert state.batches._redis is client

    async def use() -> int:
        await asyncio.gather(
            state.usage.add("test-state", {"requests": 1}),
            state.budgets.admit([Counter("test-state", 10, "key", "")], 1),
            state.limits.admit([Charge("test-state:rpm", 1, 10)], 0.0),
            state.batches.active())
        opened = _clients(redis_url)
        await state.close()
        await state.close()
        return opened

    assert asyncio.run(use()) > before
    assert _clients(redis_url) == before


def test_one_sqlite_file_per_path(tmp_path: Path) -> None:
    conns = Connections(None, tmp_path)
    assert conns.sqlite("usage.sqlite") is conns.sqlite(tmp_path / "usage.sqlite")
    assert conns.sqlite("usage.sqlite") is not conns.sqlite("keys.sqlite")
    asyncio.run(conns.close())
    with pytest.raises(RuntimeError, match="state_dir"):
        Connections(None, None).sqlite("usage.sqlite")


def test_sqlite_calls_run_off_the_event_loop_thread(tmp_path: Path) -> None:
    """Every SQLite call of the stores runs in a worker thread: the event loop never waits on the
    file (a store's ``add`` is the file's ``write``, its ``get`` the file's ``run``)."""
    conns = Connections(None, tmp_path)
    file = conns.sqlite("usage.sqlite")
    threads: list[int] = []
    run_sync, write_sync = file.run_sync, file.write_sync

    def watched(call: Any) -> Any:
        def wrapper(fn: Any) -> Any:
            def in_thread(db: sqlite3.Connection) -> Any:
                threads.append(threading.get_ident())
                return fn(db)
            return call(in_thread)
        return wrapper

    file.run_sync, file.write_sync = watched(run_sync), watched(write_sync)  # type: ignore[method-assign]

    async def use() -> int:
        usage, budgets = SqliteUsageStore(file), SqliteBudgets(file)
        await usage.add("k", {"requests": 2})
        assert await usage.get("k") == {"requests": 2}
        assert await budgets.admit([Counter("c", 10, "key", "")], 3) == ([0], -1)
        await budgets.add(["c"], 1)
        assert await budgets.get(["c"]) == [4]
        loop_thread = threading.get_ident()
        await conns.close()
        return loop_thread

    loop_thread = asyncio.run(use())
    assert len(threads) == 5 and loop_thread not in threads
