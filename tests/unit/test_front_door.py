"""The HTTP front door settings (HAProxy) and the wrapper that keeps HAProxy's listeners on loopback."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from serve_app import front_door

# The listeners of Ray Serve's HAProxy template (ray/serve/_private/haproxy_templates.py).
RAY_CONFIG = """global
    stats socket /tmp/x/admin.sock mode 666 level admin
frontend prometheus
    bind :9101
    mode http
frontend http_frontend
    bind 127.0.0.1:8000
listen stats
  bind *:8404
  stats enable
"""


def test_env_turns_on_haproxy_and_direct_ingress_with_files_in_the_run_dir(tmp_path: Path) -> None:
    env = front_door.haproxy_env(tmp_path, "127.0.0.1", "/bin/true")
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    for key in ("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "RAY_SERVE_HAPROXY_SOCKET_PATH",
                "RAY_SERVE_HAPROXY_SERVER_STATE_FILE", "RAY_SERVE_HAPROXY_BINARY_PATH"):
        assert Path(env[key]).parent == tmp_path, key
    assert env["RAY_SERVE_HAPROXY_STATS_PORT"] != env["RAY_SERVE_HAPROXY_METRICS_PORT"]
    assert os.access(env["RAY_SERVE_HAPROXY_BINARY_PATH"], os.X_OK)


def test_wrapper_pins_wildcard_binds_to_the_host_and_runs_haproxy(tmp_path: Path) -> None:
    fake = tmp_path / "fake-haproxy"
    fake.write_text('#!/bin/sh\necho "args: $*"\n')
    fake.chmod(0o755)
    env = front_door.haproxy_env(tmp_path / "run", "127.0.0.1", str(fake))
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(RAY_CONFIG)

    out = subprocess.run([env["RAY_SERVE_HAPROXY_BINARY_PATH"], "-db", "-f", str(cfg), "-dR"],
                         capture_output=True, text=True, check=True).stdout

    assert out.strip() == f"args: -db -f {cfg} -dR"
    text = cfg.read_text()
    assert "bind 127.0.0.1:9101" in text
    assert "bind 127.0.0.1:8404" in text
    assert "bind 127.0.0.1:8000" in text
    assert "bind :" not in text and "bind *:" not in text
    assert "stats socket /tmp/x/admin.sock" in text  # nothing else changes


def test_apply_keeps_values_already_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    env["RAY_SERVE_HAPROXY_STATS_PORT"] = "18404"
    monkeypatch.setattr(os, "environ", env)  # restored after the test
    monkeypatch.setattr(front_door, "haproxy_binary", lambda: "/bin/true")

    applied = front_door.apply("haproxy", tmp_path / "run", "127.0.0.1")

    assert env["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
    assert "RAY_SERVE_HAPROXY_STATS_PORT" not in applied
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"


def test_proxy_mode_changes_nothing_and_unknown_modes_are_refused(tmp_path: Path) -> None:
    assert front_door.apply("proxy", tmp_path, "127.0.0.1") == {}
    with pytest.raises(ValueError, match="haproxy, proxy"):
        front_door.apply("nginx", tmp_path, "127.0.0.1")


def test_the_bundled_haproxy_binary_is_installed() -> None:
    assert os.access(front_door.haproxy_binary(), os.X_OK)
