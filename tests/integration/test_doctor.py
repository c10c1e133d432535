"""`serve-app doctor` against the real stack: it passes, and it fails naming the right fix for a
wrong key, a base URL without /v1, and a stopped server (a closed port)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from serve_app.local.ports import free_port

pytestmark = pytest.mark.integration


def doctor(base_url: str, key: str) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "serve_app.cli", "doctor", "--base-url", base_url, "--api-key", key],
        capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin"},  # no proxy variables from the caller
    )
    print(proc.stdout, proc.stderr)
    return proc.returncode, proc.stdout


def test_doctor_passes_against_the_stack(stack: Any) -> None:
    code, out = doctor(stack.base_url, stack.keys["all"])
    assert code == 0, out
    assert out.rstrip().endswith("all checks passed")
    for name in ("model tiny-chat", "model minilm-embed", "streaming", "responses api",
                 "messages api", "prefix cache"):
        assert f"ok    {name}" in out, name


def test_doctor_wrong_key(stack: Any) -> None:
    code, out = doctor(stack.base_url, "sk-sa-not-a-key")
    assert code == 1
    assert "FAIL  api key" in out and "401: Incorrect API key provided." in out
    assert "serve-app keys create" in out


def test_doctor_base_url_without_v1(stack: Any) -> None:
    code, out = doctor(stack.root_url, stack.keys["all"])
    assert code == 1
    assert "ok    server" in out and "FAIL  base url" in out
    assert f"use --base-url {stack.root_url}/v1" in out


def test_doctor_stopped_server() -> None:
    port = free_port()  # nothing listens there
    code, out = doctor(f"http://127.0.0.1:{port}/v1", "sk-sa-any")
    assert code == 1
    assert f"nothing answers at 127.0.0.1:{port}" in out and "make run" in out
