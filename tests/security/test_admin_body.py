"""API4 (unrestricted resource consumption) and API2 (broken authentication) on the admin routes:
the key is checked before a byte of the body is read, and a body is never read past its cap.

The app is the gateway's real ASGI app (as its deployment wires it, SQLite state); the client is
a raw ASGI ``receive`` that counts the body bytes the app pulled, so "read at most" is measured,
not assumed (issue 36: a 40 MB body with no key was read whole, and ``{`` with no key got 400)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from serve_app.gateway.http.admin import ADMIN_BODY_LIMIT
from serve_app.gateway.http.api import build_api
from serve_app.gateway.keys.ops import KeyOps
from tests.keys import run
from tests.unit.test_admin_api import Admin

MIB = 1024 * 1024
CHUNK = 64 * 1024


def call(app: Any, method: str, path: str, total: int, key: str | None = None,
         body: bytes | None = None, declare_length: bool = True) -> tuple[int, dict[str, Any], int]:
    """Send ``body`` (or ``total`` bytes of filler in 64 KiB chunks) to ``app``; return the
    status, the JSON answer and how many body bytes the app read."""
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    size = len(body) if body is not None else total
    if declare_length:
        headers.append((b"content-length", str(size).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    state = {"read": 0}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if body is not None:
            if state["read"]:
                await asyncio.sleep(3600)
            state["read"] = len(body)
            return {"type": "http.request", "body": body, "more_body": False}
        if state["read"] >= total:
            await asyncio.sleep(3600)  # a client that keeps the connection open
        n = min(CHUNK, total - state["read"])
        state["read"] += n
        return {"type": "http.request", "body": b"{" * n, "more_body": state["read"] < total}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def go() -> None:
        await asyncio.wait_for(app(scope, receive, send), 10)

    asyncio.run(go())
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(payload), state["read"]


@pytest.fixture
def admin(tmp_path: Path) -> Admin:
    return Admin(tmp_path)


@pytest.mark.parametrize(("method", "path"), [("POST", "/admin/v1/keys"),
                                              ("PATCH", "/admin/v1/keys/root"),
                                              ("POST", "/admin/v1/adapters")])
@pytest.mark.parametrize("declare_length", [True, False])
def test_no_key_40_mb_body_is_refused_401_before_reading_it(
    admin: Admin, method: str, path: str, declare_length: bool,
) -> None:
    status, answer, read = call(build_api(admin.deps), method, path, 40 * MIB,
                                declare_length=declare_length)
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    assert read <= MIB  # issue 36's bound; in fact nothing is read
    assert read == 0


def test_no_key_and_broken_json_is_401_not_400(admin: Admin) -> None:
    status, answer, _ = call(build_api(admin.deps), "POST", "/admin/v1/keys", 0, body=b"{")
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("path", ["/admin/v1/keys", "/admin/v1/adapters"])
def test_a_client_key_is_403_before_its_body_is_read(admin: Admin, path: str) -> None:
    client = run(KeyOps(admin.deps.keys).create("team", tier="standard")).secret
    status, answer, read = call(build_api(admin.deps), "POST", path, 8 * MIB, key=client)
    assert status == 403 and read == 0


@pytest.mark.parametrize("path", ["/admin/v1/keys", "/admin/v1/adapters"])
@pytest.mark.parametrize("declare_length", [True, False])
def test_an_admin_body_over_the_cap_is_413_after_at_most_the_cap(
    admin: Admin, declare_length: bool, path: str,
) -> None:
    status, answer, read = call(build_api(admin.deps), "POST", path, 40 * MIB,
                                key=admin.admin, declare_length=declare_length)
    assert status == 413 and answer["error"]["code"] == "request_too_large"
    assert read <= ADMIN_BODY_LIMIT + CHUNK


def test_an_admin_body_that_fits_still_names_the_bad_field(admin: Admin) -> None:
    status, answer, _ = call(build_api(admin.deps), "POST", "/admin/v1/keys", 0, key=admin.admin,
                             body=json.dumps({"id": "x", "tier": 5}).encode())
    assert status == 400 and answer["error"]["param"] == "tier"
    status, answer, _ = call(build_api(admin.deps), "POST", "/admin/v1/keys", 0, key=admin.admin,
                             body=json.dumps({"id": "fresh", "tier": "standard"}).encode())
    assert status == 201 and answer["secret"]
