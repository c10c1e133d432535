"""serve_app.cli: the stable local demo key, key commands and config checks (no Ray started)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from serve_app.cli import DEMO_KEY_ID, ensure_demo_key, main
from serve_app.gateway.keys import KeyStore, create_key, read_keys_file, revoke_key

CONFIG_FILES = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.y*ml"))


@pytest.fixture
def paths(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "keys.yaml", tmp_path / "secret" / "demo-key.secret"


def _demo_records(keys_file: Path) -> list[tuple[str, bool]]:
    return [(k.id, k.revoked) for k in read_keys_file(keys_file).keys if k.id == DEMO_KEY_ID]


def test_demo_key_is_created_and_works(paths: tuple[Path, Path]) -> None:
    keys_file, secret_file = paths
    secret = ensure_demo_key(keys_file, secret_file)
    assert secret_file.read_text().strip() == secret
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert secret not in keys_file.read_text()
    record = KeyStore(keys_file).lookup(secret)
    assert record is not None and record.id == DEMO_KEY_ID and record.models == ("*",)


def test_demo_key_is_stable_across_runs(paths: tuple[Path, Path]) -> None:
    keys_file, secret_file = paths
    first = ensure_demo_key(keys_file, secret_file)
    assert ensure_demo_key(keys_file, secret_file) == first
    assert _demo_records(keys_file) == [(DEMO_KEY_ID, False)]


def test_revoked_demo_key_is_replaced(paths: tuple[Path, Path]) -> None:
    keys_file, secret_file = paths
    old = ensure_demo_key(keys_file, secret_file)
    revoke_key(keys_file, DEMO_KEY_ID)
    new = ensure_demo_key(keys_file, secret_file)
    assert new != old
    store = KeyStore(keys_file)
    assert store.lookup(old) is None
    assert store.lookup(new) is not None
    assert _demo_records(keys_file) == [(DEMO_KEY_ID, False)]


def test_lost_secret_file_gives_a_new_key_and_retires_the_old(paths: tuple[Path, Path]) -> None:
    keys_file, secret_file = paths
    old = ensure_demo_key(keys_file, secret_file)
    secret_file.unlink()
    new = ensure_demo_key(keys_file, secret_file)
    assert new != old
    assert KeyStore(keys_file).lookup(old) is None
    assert _demo_records(keys_file) == [(DEMO_KEY_ID, False)]


def test_other_keys_are_left_alone(paths: tuple[Path, Path]) -> None:
    keys_file, secret_file = paths
    team = create_key(keys_file, "team", "premium", ["tiny-chat"])
    ensure_demo_key(keys_file, secret_file)
    revoke_key(keys_file, DEMO_KEY_ID)
    ensure_demo_key(keys_file, secret_file)
    record = KeyStore(keys_file).lookup(team)
    assert record is not None and record.tier == "premium"


def test_keys_commands_create_list_revoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys_file = str(tmp_path / "keys.yaml")
    assert main(["keys", "--keys-file", keys_file, "create", "--id", "k1", "--models", "tiny"]) == 0
    secret = capsys.readouterr().out.strip().splitlines()[-1]
    assert KeyStore(Path(keys_file)).lookup(secret) is not None
    assert main(["keys", "--keys-file", keys_file, "list"]) == 0
    listing = capsys.readouterr().out
    assert "k1" in listing and "active" in listing and secret not in listing
    assert main(["keys", "--keys-file", keys_file, "revoke", "--id", "k1"]) == 0
    capsys.readouterr()
    assert KeyStore(Path(keys_file)).lookup(secret) is None
    # Errors are reported, not raised.
    assert main(["keys", "--keys-file", keys_file, "revoke", "--id", "nope"]) == 2
    assert "no key with id 'nope'" in capsys.readouterr().err


def test_check_config_accepts_shipped_configs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", *map(str, CONFIG_FILES)]) == 0
    assert capsys.readouterr().out.count(": ok (") == len(CONFIG_FILES)


def test_check_config_reports_bad_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "applications:\n"
        "  - name: llm\n"
        "    import_path: serve_app.app:build_app\n"
        "    args:\n"
        "      models:\n"
        "        - {id: m, source: x, engine: {max_num_seqs: 0}}\n"
    )
    assert main(["check-config", str(bad)]) == 1
    assert "args.models.0.engine.max_num_seqs" in capsys.readouterr().err
