"""serve_app.gateway.keys.store: the three key stores behind one interface, and the key operations
that the admin API and ``serve-app keys`` share."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from serve_app.config import GatewayConfig
from serve_app.gateway.keys.keyfile import KeyConflict, KeyNotFound, KeysFileError, StoreReadOnly
from serve_app.gateway.keys.keyfile import KeyStore as FileKeyStore
from serve_app.gateway.keys.store import (
    POLL_S,
    KeyOps,
    KeyStore,
    RedisKeyStore,
    SqliteKeyStore,
    open_key_store,
)
from tests.unit.fakes import StepClock

KINDS = ["file", "sqlite", "redis"]


def _open(kind: str, tmp_path: Path, request: pytest.FixtureRequest, clock: StepClock,
          read_only: bool = False, prefix: str = "") -> KeyStore:
    if kind == "file":
        return FileKeyStore(tmp_path / "keys.yaml", POLL_S, clock, read_only=read_only)
    if kind == "sqlite":
        return SqliteKeyStore(tmp_path / "keys.sqlite", read_only=read_only, clock=clock)
    return RedisKeyStore(request.getfixturevalue("redis_url"), read_only=read_only, clock=clock,
                         prefix=prefix or f"test:keys:{uuid.uuid4().hex}")


@pytest.mark.parametrize("kind", KINDS)
def test_create_rotate_revoke_update(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    clock = StepClock()
    store = _open(kind, tmp_path, request, clock)
    ops = KeyOps(store)
    issued = ops.create("team-a", tier="premium", models=["tiny-chat"], tenant="acme",
                        budget={"tokens": 1000, "period": "day"})
    assert issued.secret.startswith("sk-sa-")
    assert issued.secret not in issued.record.model_dump_json()  # only the digest is kept
    assert store.lookup(issued.secret) == issued.record
    with pytest.raises(KeyConflict):
        ops.create("team-a")
    rotated = ops.rotate("team-a")
    assert store.lookup(issued.secret) is None and store.lookup(rotated.secret) is not None
    updated = ops.update("team-a", {"tier": "batch", "expires_at": "2030-01-01T00:00:00Z"})
    assert updated.tier == "batch" and updated.tenant == "acme"
    assert store.lookup(rotated.secret) == updated
    with pytest.raises(KeysFileError, match="digest"):
        ops.update("team-a", {"digest": "sha256:" + "0" * 64})
    ops.revoke("team-a")
    assert store.lookup(rotated.secret) is None
    assert [k.id for k in ops.list()] == ["team-a"] and ops.get("team-a").revoked
    with pytest.raises(KeyNotFound):
        ops.revoke("nobody")
    store.close()


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_another_replica_sees_a_change_within_the_poll(kind: str, tmp_path: Path,
                                                         request: pytest.FixtureRequest) -> None:
    """Two stores on the same data stand for two gateway replicas."""
    prefix = f"test:keys:{uuid.uuid4().hex}"
    clock = StepClock()
    admin = _open(kind, tmp_path, request, clock, prefix=prefix)
    replica = _open(kind, tmp_path, request, clock, prefix=prefix)
    issued = KeyOps(admin).create("k1")
    assert replica.lookup(issued.secret) is None  # polled less than POLL_S ago
    clock.step(POLL_S)
    assert replica.lookup(issued.secret) is not None
    KeyOps(admin).revoke("k1")
    clock.step(POLL_S)
    assert replica.lookup(issued.secret) is None
    admin.close()
    replica.close()


@pytest.mark.parametrize("kind", KINDS)
def test_read_only_store_refuses_writes(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    store = _open(kind, tmp_path, request, StepClock(), read_only=True)
    with pytest.raises(StoreReadOnly, match="read-only"):
        KeyOps(store).create("k1")
    store.close()


def test_sqlite_keys_survive_a_restart(tmp_path: Path) -> None:
    issued = KeyOps(SqliteKeyStore(tmp_path / "keys.sqlite")).create("k1")
    assert SqliteKeyStore(tmp_path / "keys.sqlite").lookup(issued.secret) is not None


def test_open_key_store_follows_the_config(tmp_path: Path) -> None:
    gw = GatewayConfig(keys_file=str(tmp_path / "k.yaml"), keys_store="sqlite",
                       state_dir=str(tmp_path / "state"))
    assert isinstance(open_key_store(gw), SqliteKeyStore)
    assert isinstance(open_key_store(GatewayConfig(keys_file=str(tmp_path / "k.yaml"))), FileKeyStore)
    with pytest.raises(ValueError, match="needs gateway.redis_url"):
        GatewayConfig(keys_store="redis")


def test_expiry() -> None:
    from serve_app.config import KeyRecord

    k = KeyRecord(id="k", digest="sha256:" + "0" * 64, expires_at="2030-01-01T00:00:00")
    assert not k.expired(1_800_000_000) and k.expired(1_900_000_000)
    with pytest.raises(ValueError, match="expires_at"):
        KeyRecord(id="k", digest="sha256:" + "0" * 64, expires_at="tomorrow")


def test_demo_key_in_a_database_store_is_stable(tmp_path: Path) -> None:
    from serve_app.local.demo_key import DEMO_KEY_ID, ensure_demo_key_in

    store = SqliteKeyStore(tmp_path / "keys.sqlite")
    secret_file = tmp_path / "demo-key.secret"
    first = ensure_demo_key_in(store, secret_file)
    assert ensure_demo_key_in(store, secret_file) == first
    KeyOps(store).revoke(DEMO_KEY_ID)
    again = ensure_demo_key_in(store, secret_file)
    assert again != first and store.lookup(again) is not None and store.lookup(first) is None


def test_cli_creates_admin_keys_with_expiry_and_budget(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from serve_app.cli import main

    keys_file = str(tmp_path / "keys.yaml")
    assert main(["keys", "create", "--keys-file", keys_file, "--id", "ops", "--role", "admin",
                 "--expires-at", "2030-01-01T00:00:00Z", "--budget-tokens", "5000",
                 "--budget-period", "day"]) == 0
    secret = capsys.readouterr().out.strip().splitlines()[-1]
    record = FileKeyStore(Path(keys_file)).lookup(secret)
    assert record is not None and record.role == "admin" and record.budget is not None
    assert main(["keys", "list", "--keys-file", keys_file]) == 0
    out = capsys.readouterr().out
    assert "role=admin" in out and "expires_at=2030-01-01T00:00:00Z" in out and "budget=5000/day" in out
    assert main(["keys", "create", "--keys-file", keys_file, "--id", "x", "--expires-at", "soon"]) == 2
    assert "expires_at" in capsys.readouterr().err
