"""serve_app.state.keys and serve_app.gateway.keys.ops: the three key stores behind one interface,
and the one set of key operations that the admin API, ``serve-app keys`` and the demo key share."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from serve_app.config import GatewayConfig, KeyRecord, KeysConfig
from serve_app.gateway.keys.ops import KeyOps
from serve_app.state.connections import Connections
from serve_app.state.keys import (
    POLL_S,
    FileKeyStore,
    KeyConflict,
    KeyNotFound,
    KeysFileError,
    KeyStore,
    RedisKeyStore,
    SqliteKeyStore,
    StoreReadOnly,
    keep_fresh,
    open_key_store,
)
from tests.keys import file_store
from tests.unit.fakes import StepClock

KINDS = ["file", "sqlite", "redis"]


@asynccontextmanager
async def _open(kind: str, tmp_path: Path, request: pytest.FixtureRequest, clock: StepClock,
                read_only: bool = False, prefix: str = "") -> AsyncIterator[KeyStore]:
    """A loaded store of ``kind`` on connections of its own (one gateway replica's)."""
    redis_url = request.getfixturevalue("redis_url") if kind == "redis" else None
    connections = Connections(redis_url, tmp_path)
    store: KeyStore
    if kind == "file":
        store = FileKeyStore(tmp_path / "keys.yaml", POLL_S, clock, read_only=read_only)
    elif kind == "sqlite":
        store = SqliteKeyStore(connections.sqlite("keys.sqlite"), read_only=read_only, clock=clock)
    else:
        store = RedisKeyStore(connections.redis(), read_only=read_only, clock=clock,
                              prefix=prefix or f"test:keys:{uuid.uuid4().hex}")
    try:
        await store.refresh(force=True)
        yield store
    finally:
        await connections.close()


def _run(kind: str, tmp_path: Path, request: pytest.FixtureRequest,
         body: Callable[[KeyStore, StepClock], Awaitable[None]], **kw: Any) -> None:
    async def go() -> None:
        clock = StepClock()
        async with _open(kind, tmp_path, request, clock, **kw) as store:
            await body(store, clock)

    asyncio.run(go())


@pytest.mark.parametrize("kind", KINDS)
def test_create_rotate_revoke_update(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    async def body(store: KeyStore, clock: StepClock) -> None:
        ops = KeyOps(store)
        issued = await ops.create("team-a", tier="premium", models=["tiny-chat"], tenant="acme",
                                  budget={"tokens": 1000, "period": "day"})
        assert issued.secret.startswith("sk-sa-")
        assert issued.secret not in issued.record.model_dump_json()  # only the digest is kept
        assert store.lookup(issued.secret) == issued.record
        with pytest.raises(KeyConflict):
            await ops.create("team-a")
        rotated = await ops.rotate("team-a")
        assert store.lookup(issued.secret) is None and store.lookup(rotated.secret) is not None
        updated = await ops.update("team-a", {"tier": "batch", "expires_at": "2030-01-01T00:00:00Z"})
        assert updated.tier == "batch" and updated.tenant == "acme"
        assert store.lookup(rotated.secret) == updated
        with pytest.raises(KeysFileError, match="digest"):
            await ops.update("team-a", {"digest": "sha256:" + "0" * 64})
        await ops.revoke("team-a")
        assert store.lookup(rotated.secret) is None
        assert [k.id for k in await ops.list()] == ["team-a"] and (await ops.get("team-a")).revoked
        with pytest.raises(KeyNotFound):
            await ops.revoke("nobody")

    _run(kind, tmp_path, request, body)


def test_every_store_gives_the_same_answers(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The same operations over the file, SQLite and Redis: the same records (but for secrets
    and times), the same lookups, the same errors with the same messages."""

    async def script(store: KeyStore) -> list[Any]:
        ops, seen = KeyOps(store), []

        async def attempt(step: Awaitable[Any]) -> None:
            try:
                out = await step
            except KeysFileError as exc:
                seen.append((type(exc).__name__, str(exc)))
            else:
                seen.append(type(out).__name__)

        a = await ops.create("a", tier="premium", models=["tiny-chat"], limits={"rpm": 5})
        b = await ops.create("b", tenant="acme")
        await attempt(ops.create("a"))
        a2 = await ops.rotate("a")
        await ops.revoke("b")
        await attempt(ops.rotate("b"))
        await attempt(ops.revoke("nobody"))
        await attempt(ops.update("a", {"role": "admin"}))
        await attempt(ops.update("a", {"tier": "batch"}))
        seen.append([store.lookup(s) is not None for s in (a.secret, a2.secret, b.secret)])
        seen.append([(k.id, k.revoked) for k in [store.by_id("a"), store.by_id("b")] if k])
        listed = sorted(await ops.list(), key=lambda k: k.id)  # each store keeps its own order
        seen.append([k.model_dump(exclude={"digest", "created_at"}) for k in listed])
        return seen

    answers = {}
    for kind in KINDS:
        async def go(kind: str = kind) -> list[Any]:
            async with _open(kind, tmp_path / kind, request, StepClock()) as store:
                return await script(store)

        answers[kind] = asyncio.run(go())
    assert answers["file"] == answers["sqlite"] == answers["redis"]
    assert answers["file"][0] == ("KeyConflict", "key id 'a' already exists; revoke it or choose "
                                                 "another id")
    assert answers["file"][-3] == [False, True, False]


def test_sqlite_statements_run_off_the_event_loop(tmp_path: Path) -> None:
    """Every statement of the SQLite store (create, rotate, revoke, list, the poll) runs in a
    worker thread: the event loop never waits on the file."""
    threads: set[int] = set()

    async def go() -> int:
        connections = Connections(None, tmp_path)
        file = connections.sqlite("keys.sqlite")
        file.db.set_trace_callback(lambda _sql: threads.add(threading.get_ident()))
        clock = StepClock()
        store = SqliteKeyStore(file, clock=clock)
        ops = KeyOps(store)
        await store.refresh(force=True)
        await ops.create("k1")
        await ops.rotate("k1")
        await ops.revoke("k1")
        await ops.list()
        clock.step(POLL_S)
        await store.refresh()
        await connections.close()
        return threading.get_ident()

    loop_thread = asyncio.run(go())
    assert threads and loop_thread not in threads


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_another_replica_sees_a_change_within_the_poll(kind: str, tmp_path: Path,
                                                         request: pytest.FixtureRequest) -> None:
    """Two stores on the same data, each on its own connections, stand for two gateway replicas;
    ``refresh`` is the replica's poll (``keep_fresh``)."""
    prefix = f"test:keys:{uuid.uuid4().hex}"

    async def go() -> None:
        clock = StepClock()
        async with (_open(kind, tmp_path, request, clock, prefix=prefix) as admin,
                    _open(kind, tmp_path, request, clock, prefix=prefix) as replica):
            issued = await KeyOps(admin).create("k1")
            await replica.refresh()
            assert replica.lookup(issued.secret) is None  # polled less than POLL_S ago
            clock.step(POLL_S)
            await replica.refresh()
            assert replica.lookup(issued.secret) is not None
            await KeyOps(admin).revoke("k1")
            clock.step(POLL_S)
            await replica.refresh()
            assert replica.lookup(issued.secret) is None

    asyncio.run(go())


@pytest.mark.parametrize("kind", KINDS)
def test_read_only_store_refuses_writes(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    async def body(store: KeyStore, clock: StepClock) -> None:
        with pytest.raises(StoreReadOnly, match="read-only"):
            await KeyOps(store).create("k1")

    _run(kind, tmp_path, request, body, read_only=True)


def test_sqlite_keys_survive_a_restart(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    async def go() -> None:
        async with _open("sqlite", tmp_path, request, StepClock()) as store:
            issued = await KeyOps(store).create("k1")
        async with _open("sqlite", tmp_path, request, StepClock()) as store:
            assert store.lookup(issued.secret) is not None

    asyncio.run(go())


def test_keep_fresh_polls_every_interval(tmp_path: Path) -> None:
    """A replica's background poll picks a change up without any request."""

    async def go() -> None:
        admin, replica = Connections(None, tmp_path), Connections(None, tmp_path)
        store = SqliteKeyStore(replica.sqlite("keys.sqlite"))
        await store.refresh(force=True)
        poll = asyncio.get_running_loop().create_task(keep_fresh(store))
        issued = await KeyOps(SqliteKeyStore(admin.sqlite("keys.sqlite"))).create("k1")
        for _ in range(100):
            if store.lookup(issued.secret) is not None:
                break
            await asyncio.sleep(POLL_S / 5)
        poll.cancel()
        assert store.lookup(issued.secret) is not None
        await admin.close()
        await replica.close()

    asyncio.run(go())


def test_open_key_store_follows_the_config(tmp_path: Path) -> None:
    gw = GatewayConfig(keys={"file": str(tmp_path / "k.yaml"), "store": "sqlite"},
                       state={"dir": str(tmp_path / "state")})
    connections = Connections.of(gw.state)
    store = open_key_store(gw.keys, connections)
    assert isinstance(store, SqliteKeyStore)
    assert store.location == str((tmp_path / "state" / "keys.sqlite").resolve())
    assert isinstance(open_key_store(KeysConfig(file=str(tmp_path / "k.yaml")), connections),
                      FileKeyStore)
    asyncio.run(connections.close())
    with pytest.raises(ValueError, match="needs gateway.state.redis_url"):
        GatewayConfig(keys={"store": "redis"})


def test_expiry() -> None:
    k = KeyRecord(id="k", digest="sha256:" + "0" * 64, expires_at="2030-01-01T00:00:00")
    assert not k.expired(1_800_000_000) and k.expired(1_900_000_000)
    with pytest.raises(ValueError, match="expires_at"):
        KeyRecord(id="k", digest="sha256:" + "0" * 64, expires_at="tomorrow")


@pytest.mark.parametrize("kind", KINDS)
def test_demo_key_is_stable_in_every_store(kind: str, tmp_path: Path,
                                           request: pytest.FixtureRequest) -> None:
    from serve_app.local.demo_key import DEMO_KEY_ID, ensure_demo_key

    secret_file = tmp_path / "demo-key.secret"

    async def body(store: KeyStore, clock: StepClock) -> None:
        first = await ensure_demo_key(store, secret_file)
        assert await ensure_demo_key(store, secret_file) == first
        await KeyOps(store).revoke(DEMO_KEY_ID)
        again = await ensure_demo_key(store, secret_file)
        assert again != first and store.lookup(again) is not None and store.lookup(first) is None
        assert [(k.id, k.revoked) for k in await KeyOps(store).list()] == [(DEMO_KEY_ID, False)]

    _run(kind, tmp_path, request, body)


def test_cli_creates_admin_keys_with_expiry_and_budget(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from serve_app.cli import main

    keys_file = str(tmp_path / "keys.yaml")
    assert main(["keys", "create", "--keys-file", keys_file, "--id", "ops", "--role", "admin",
                 "--expires-at", "2030-01-01T00:00:00Z", "--budget-tokens", "5000",
                 "--budget-period", "day"]) == 0
    secret = capsys.readouterr().out.strip().splitlines()[-1]
    record = file_store(Path(keys_file)).lookup(secret)
    assert record is not None and record.role == "admin" and record.budget is not None
    assert main(["keys", "list", "--keys-file", keys_file]) == 0
    out = capsys.readouterr().out
    assert "role=admin" in out and "expires_at=2030-01-01T00:00:00Z" in out and "budget=5000/day" in out
    assert main(["keys", "create", "--keys-file", keys_file, "--id", "x", "--expires-at", "soon"]) == 2
    assert "expires_at" in capsys.readouterr().err
