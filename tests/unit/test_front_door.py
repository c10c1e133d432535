"""The HTTP front door settings (HAProxy) and the wrapper that keeps HAProxy's listeners on loopback."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from serve_app.gateway.accounting.timing import arrival_from_headers
from serve_app.local import front_door

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


def test_error_files_are_openai_shaped_http_responses(tmp_path: Path) -> None:
    front_door.write_error_files(tmp_path)
    for status in (400, 403, 404, 405, 408, 500, 502, 503, 504):
        raw = (tmp_path / f"{status}.http").read_bytes()
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        assert lines[0].startswith(f"HTTP/1.1 {status} ")
        assert "Content-Type: application/json" in lines
        assert f"Content-Length: {len(body)}" in lines
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert ("Retry-After: 1" in lines) == (status in (502, 503, 504))
    assert json.loads((tmp_path / "408.json").read_bytes())["error"]["code"] == "request_timeout"


RAY_TEMPLATE_LIKE = """global
    maxconn 100
defaults
    mode http
    timeout connect 5s
    timeout client 3600s
    timeout server 3600s
    errorfile 502 {d}/500.http
    errorfile 503 {d}/500.http
    errorfile 504 {d}/500.http
frontend http_frontend
    bind 127.0.0.1:8000
    acl is_x path_beg /
    use_backend x if is_x
    default_backend default_backend
backend default_backend
    http-request return status 404 content-type text/plain lf-string "Path '%[path]' not found."
backend x
    server s1 127.0.0.1:8001
listen stats
  bind *:8404
  stats enable
"""


def test_wrapper_adds_timeout_error_files_and_method_rules_that_haproxy_accepts(tmp_path: Path) -> None:
    env = front_door.haproxy_env(tmp_path / "run", "127.0.0.1", front_door.haproxy_binary())
    (tmp_path / "500.http").write_text("HTTP/1.1 500 x\r\nContent-Length: 0\r\n\r\n")
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(RAY_TEMPLATE_LIKE.format(d=tmp_path))
    wrapper = env["RAY_SERVE_HAPROXY_BINARY_PATH"]
    for _ in range(2):  # Ray runs the binary on each start and reload: the edit is made once
        out = subprocess.run([wrapper, "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
    text = cfg.read_text()
    assert f"timeout http-request {front_door.HTTP_REQUEST_TIMEOUT_S}s" in text
    assert text.count("timeout http-request") == 1
    assert f"{tmp_path}/500.http" not in text  # Ray's text/plain 500 for 502/503/504
    for status in (400, 408, 502, 503, 504):
        assert f"errorfile {status} {tmp_path}/run/errors/{status}.http" in text
    assert "unless serve_app_method" in text
    assert "text/plain" not in text and "%[path]" not in text  # the 404 echoed the path
    assert "bind 127.0.0.1:8404" in text


def test_throughput_mode_is_on_with_haproxy(tmp_path: Path) -> None:
    env = front_door.haproxy_env(tmp_path, "127.0.0.1", "/bin/true")
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH" not in env  # no request crosses Ray's gRPC


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_haproxy(tmp_path: Path, backend: str) -> tuple[int, subprocess.Popen[bytes]]:
    """The real HAProxy, through the wrapper ``serve-app run`` uses (so with the project's rules),
    on a Ray-like config whose backend is the HAProxy line ``backend``; its port and process."""
    port = _free_port()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(RAY_TEMPLATE_LIKE.format(d=tmp_path)
                   .replace("127.0.0.1:8000", f"127.0.0.1:{port}")
                   .replace("server s1 127.0.0.1:8001", backend)
                   .replace("*:8404", f"*:{_free_port()}"))
    (tmp_path / "500.http").write_text("HTTP/1.1 500 x\r\nContent-Length: 0\r\n\r\n")
    env = front_door.haproxy_env(tmp_path / "run", "127.0.0.1", front_door.haproxy_binary())
    proc = subprocess.Popen([env["RAY_SERVE_HAPROXY_BINARY_PATH"], "-db", "-f", str(cfg)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return port, proc


def test_haproxy_stamps_each_request_on_arrival_and_drops_the_clients_stamp(tmp_path: Path) -> None:
    # The backend answers from HAProxy itself with what it received: how many stamps, and the stamp.
    echo = ('http-request return status 200 content-type text/plain '
            'lf-string "%[req.hdr_cnt(X-Request-Start)] %[req.hdr(X-Request-Start)]"')
    port, proc = start_haproxy(tmp_path, echo)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    answers = []
    try:
        for _ in range(100):
            try:
                conn.connect()
                break
            except OSError:
                conn.close()
                time.sleep(0.05)
        for _ in range(2):  # one keep-alive connection: each request gets its own stamp
            sent = time.time()
            conn.request("GET", "/v1/models", headers={"X-Request-Start": "t=1"})
            answers.append((sent, conn.getresponse().read().decode()))
            time.sleep(0.3)
    finally:
        conn.close()
        proc.kill()
        proc.wait()
    for sent, answer in answers:
        count, stamp = answer.split(" ")
        assert count == "1" and stamp.startswith("t=") and len(stamp) == 18  # microseconds
        arrival = arrival_from_headers({"x-request-start": stamp}, time.time())
        assert arrival is not None and sent - 0.01 <= arrival <= sent + 0.25
