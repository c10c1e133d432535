"""serve_app.state.keys: the YAML keys file, its edits (through ``KeyOps``), and the hot-reloading
FileKeyStore."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import yaml

from serve_app.state.keys import FileKeyStore, KeysFileError, digest, read_keys_file
from tests.keys import create_key, file_store, revoke_key, run
from tests.unit.fakes import StepClock

RELOAD_S = 1.0


@pytest.fixture
def keys_path(tmp_path: Path) -> Path:
    return tmp_path / "conf" / "keys.yaml"


@pytest.fixture
def clock() -> StepClock:
    return StepClock()


def _store(path: Path, clock: StepClock) -> FileKeyStore:
    return file_store(path, RELOAD_S, clock=clock)


def _wait_reload(store: FileKeyStore, clock: StepClock) -> None:
    """The interval passes and the replica's poll runs (``keep_fresh``)."""
    clock.step(RELOAD_S)
    run(store.refresh())


# ---- file edits --------------------------------------------------------------------------------
def test_create_key_stores_digest_not_secret(keys_path: Path) -> None:
    secret = create_key(keys_path, "team-a", "premium", ["tiny-chat"])
    text = keys_path.read_text()
    assert secret not in text
    assert digest(secret) in text
    (record,) = read_keys_file(keys_path).keys
    assert record.id == "team-a"
    assert record.digest == digest(secret)
    assert record.tier == "premium"
    assert record.models == ("tiny-chat",)
    assert record.revoked is False
    assert record.created_at  # an ISO timestamp


def test_keys_file_is_private(keys_path: Path) -> None:
    create_key(keys_path, "k", "standard", [])
    assert stat.S_IMODE(keys_path.stat().st_mode) == 0o600


def test_create_key_without_models_allows_all(keys_path: Path) -> None:
    create_key(keys_path, "k", "standard", [])
    assert read_keys_file(keys_path).keys[0].models == ("*",)


def test_create_key_keeps_existing_keys(keys_path: Path) -> None:
    s1 = create_key(keys_path, "k1", "standard", ["*"])
    s2 = create_key(keys_path, "k2", "standard", ["*"])
    assert s1 != s2
    assert [k.id for k in read_keys_file(keys_path).keys] == ["k1", "k2"]


def test_create_key_refuses_duplicate_id(keys_path: Path) -> None:
    create_key(keys_path, "k1", "standard", ["*"])
    with pytest.raises(KeysFileError, match="'k1' already exists"):
        create_key(keys_path, "k1", "standard", ["*"])


def test_revoke_marks_only_that_key(keys_path: Path) -> None:
    create_key(keys_path, "k1", "standard", ["*"])
    create_key(keys_path, "k2", "standard", ["*"])
    revoke_key(keys_path, "k1")
    state = {k.id: k.revoked for k in read_keys_file(keys_path).keys}
    assert state == {"k1": True, "k2": False}


def test_revoke_unknown_key(keys_path: Path) -> None:
    create_key(keys_path, "k1", "standard", ["*"])
    with pytest.raises(KeysFileError, match="no key with id 'nope'"):
        revoke_key(keys_path, "nope")


def test_missing_file_reads_as_no_keys(keys_path: Path) -> None:
    assert read_keys_file(keys_path).keys == ()


def test_broken_yaml_is_a_keys_file_error(keys_path: Path) -> None:
    keys_path.parent.mkdir(parents=True)
    keys_path.write_text("keys: [\n")
    with pytest.raises(KeysFileError, match="not valid YAML"):
        read_keys_file(keys_path)


def test_invalid_record_names_the_field(keys_path: Path) -> None:
    keys_path.parent.mkdir(parents=True)
    keys_path.write_text(yaml.safe_dump({"keys": [{"id": "k1", "digest": "plain"}]}))
    with pytest.raises(KeysFileError, match=r"keys\.keys\.0\.digest"):
        read_keys_file(keys_path)


# ---- KeyStore ----------------------------------------------------------------------------------
def test_lookup_finds_active_key(keys_path: Path, clock: StepClock) -> None:
    secret = create_key(keys_path, "k1", "premium", ["*"])
    store = _store(keys_path, clock)
    record = store.lookup(secret)
    assert record is not None and record.id == "k1" and record.tier == "premium"


def test_lookup_rejects_unknown_secret(keys_path: Path, clock: StepClock) -> None:
    secret = create_key(keys_path, "k1", "standard", ["*"])
    store = _store(keys_path, clock)
    assert store.lookup(secret + "x") is None
    assert store.lookup("") is None
    assert store.lookup(digest(secret)) is None  # the stored digest is not itself a key


def test_lookup_rejects_revoked_key_at_startup(keys_path: Path, clock: StepClock) -> None:
    secret = create_key(keys_path, "k1", "standard", ["*"])
    revoke_key(keys_path, "k1")
    assert _store(keys_path, clock).lookup(secret) is None


def test_revocation_is_picked_up_without_restart(keys_path: Path, clock: StepClock) -> None:
    secret = create_key(keys_path, "k1", "standard", ["*"])
    store = _store(keys_path, clock)
    assert store.lookup(secret) is not None
    revoke_key(keys_path, "k1")
    _wait_reload(store, clock)
    assert store.lookup(secret) is None


def test_new_key_is_picked_up_without_restart(keys_path: Path, clock: StepClock) -> None:
    create_key(keys_path, "k1", "standard", ["*"])
    store = _store(keys_path, clock)
    secret = create_key(keys_path, "k2", "standard", ["*"])
    _wait_reload(store, clock)
    record = store.lookup(secret)
    assert record is not None and record.id == "k2"


def test_reload_is_rate_limited(keys_path: Path, clock: StepClock) -> None:
    create_key(keys_path, "k1", "standard", ["*"])
    store = _store(keys_path, clock)  # reads the file now; the next check waits for the interval
    secret = create_key(keys_path, "k2", "standard", ["*"])
    run(store.refresh())
    assert store.lookup(secret) is None  # the file is not re-read on every poll
    clock.step(RELOAD_S * 0.9)
    run(store.refresh())
    assert store.lookup(secret) is None
    clock.step(RELOAD_S * 0.1)
    run(store.refresh())
    assert store.lookup(secret) is not None


def test_broken_edit_keeps_old_keys(keys_path: Path, clock: StepClock) -> None:
    secret = create_key(keys_path, "k1", "standard", ["*"])
    store = _store(keys_path, clock)
    good = keys_path.read_text()
    keys_path.write_text(good + "\n  - : [unbalanced\n")
    _wait_reload(store, clock)
    assert store.lookup(secret) is not None
    # An edit that is valid YAML but not a valid keys file is kept out too.
    keys_path.write_text(yaml.safe_dump({"keys": [{"id": "k1", "digest": "oops"}]}))
    _wait_reload(store, clock)
    assert store.lookup(secret) is not None
    # A later good edit is picked up.
    other = create_key(keys_path.with_name("other.yaml"), "k2", "standard", ["*"])
    keys_path.write_text(keys_path.with_name("other.yaml").read_text())
    _wait_reload(store, clock)
    assert store.lookup(secret) is None
    assert store.lookup(other) is not None


def test_missing_file_means_no_keys_until_created(keys_path: Path, clock: StepClock) -> None:
    store = _store(keys_path, clock)
    assert store.lookup("sk-sa-anything") is None
    secret = create_key(keys_path, "k1", "standard", ["*"])
    _wait_reload(store, clock)
    assert store.lookup(secret) is not None
