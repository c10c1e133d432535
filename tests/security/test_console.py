"""The console's defences (/console): a session is only what the gateway signed, for an admin key
that is still active, not expired and not rotated; every POST needs the session's CSRF token and
must come from the console's own site. Each test here fails when its defence is taken out."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_app.gateway.http.console_session import COOKIE, Signer
from serve_app.gateway.keys.ops import KeyOps
from tests.keys import run
from tests.unit.console_client import Console
from tests.unit.test_admin_api import Admin


@pytest.fixture
def console(tmp_path: Path) -> Iterator[Console]:
    a = Admin(tmp_path)
    with a.client:
        c = Console(a)
        assert c.signin(a.admin).status_code == 303
        yield c


def _signed_out(c: Console) -> None:
    resp = c.get("/console/keys")
    assert resp.status_code == 303 and resp.headers["location"] == "/console/signin"


def _with_cookie(c: Console, value: str) -> None:
    c.client.cookies.clear()
    c.client.cookies.set(COOKIE, value, path="/console")


def _secret(c: Console) -> bytes:
    return (c.admin.state / "console.secret").read_bytes().strip()


def test_the_cookie_holds_no_secret(console: Console) -> None:
    cookie = console.cookie or ""
    assert console.admin.admin not in cookie and _secret(console).decode() not in cookie
    payload = json.loads(base64.urlsafe_b64decode(cookie.split(".")[0] + "=="))
    assert set(payload) == {"k", "m", "e", "n"} and payload["k"] == "root"


def test_a_forged_cookie_is_signed_out(console: Console) -> None:
    forged = Signer(b"x" * 64, 3600).issue(run(KeyOps(console.admin.deps.keys).get("root")))
    _with_cookie(console, forged)
    _signed_out(console)
    for junk in ("", "abc", "a.b", "a.b.c", "%%%.%%%"):
        _with_cookie(console, junk)
        _signed_out(console)


def test_a_tampered_cookie_is_signed_out(console: Console) -> None:
    """Another admin's id (or a later expiry) under the first session's mac."""
    run(KeyOps(console.admin.deps.keys).create("root2", role="admin"))
    payload, mac = (console.cookie or "").split(".")
    doc = json.loads(base64.urlsafe_b64decode(payload + "=="))
    for change in ({"k": "root2"}, {"e": doc["e"] + 10**6}):
        bent = base64.urlsafe_b64encode(json.dumps({**doc, **change}).encode()).rstrip(b"=").decode()
        _with_cookie(console, f"{bent}.{mac}")
        _signed_out(console)


def test_an_expired_session_is_signed_out(console: Console) -> None:
    root = run(KeyOps(console.admin.deps.keys).get("root"))
    past = Signer(_secret(console), 3600, clock=lambda: 1_000_000.0).issue(root)
    _with_cookie(console, past)
    _signed_out(console)
    _with_cookie(console, Signer(_secret(console), 3600).issue(root))  # same secret, now: good
    assert console.get("/console/keys").status_code == 200


def test_revoking_the_admin_key_ends_its_session(console: Console) -> None:
    run(KeyOps(console.admin.deps.keys).revoke("root"))
    _signed_out(console)


def test_rotating_or_expiring_the_admin_key_ends_its_session(console: Console) -> None:
    run(KeyOps(console.admin.deps.keys).rotate("root"))
    _signed_out(console)
    ops = KeyOps(console.admin.deps.keys)
    secret = run(ops.create("root2", role="admin")).secret
    assert console.signin(secret).status_code == 303
    run(ops.update("root2", {"expires_at": "2020-01-01T00:00:00Z"}))
    _signed_out(console)


def test_a_session_of_a_key_demoted_to_client_ends(console: Console) -> None:
    ops = KeyOps(console.admin.deps.keys)
    run(console.admin.deps.keys.change("root", lambda k: k.model_copy(update={"role": "client"})))
    assert run(ops.get("root")).role == "client"
    _signed_out(console)


@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"},
    {"Origin": "null"},
    {"Referer": "http://evil.example/page"},
    {"Sec-Fetch-Site": "cross-site"},
    {"Origin": "http://testserver.evil.example"},
])
def test_a_cross_site_post_is_refused_even_with_the_token(console: Console,
                                                          headers: dict[str, str]) -> None:
    token = console.csrf()
    resp = console.post("/console/keys", csrf=token, headers=headers, id="made-cross-site")
    assert resp.status_code == 403 and "Cross-site" in resp.text
    assert "made-cross-site" not in {k.id for k in run(KeyOps(console.admin.deps.keys).list())}
    signin = console.client.post("/console/signin", data={"key": console.admin.admin},
                                 headers=headers, follow_redirects=False)
    assert signin.status_code == 403 and "set-cookie" not in signin.headers
    same = console.post("/console/keys", csrf=token, headers={"Origin": "http://testserver",
                                                              "Sec-Fetch-Site": "same-origin"},
                        id="made-here")
    assert same.status_code == 200, same.text


def test_a_post_without_the_sessions_csrf_token_is_refused(console: Console) -> None:
    ops = KeyOps(console.admin.deps.keys)
    run(ops.create("victim"))
    assert console.post("/console/keys/victim/revoke", csrf=None).status_code == 403
    assert console.post("/console/keys/victim/revoke", csrf="").status_code == 403
    other = Signer(_secret(console), 3600).issue(run(ops.get("root")))  # another session's token
    wrong = Signer(_secret(console), 3600).csrf(Signer(_secret(console), 3600).read(other))  # type: ignore[arg-type]
    resp = console.post("/console/keys/victim/revoke", csrf=wrong)
    assert resp.status_code == 403 and "CSRF" in resp.text
    assert console.post("/console/signout", csrf=None).status_code == 403
    assert not run(ops.get("victim")).revoked
    assert console.get("/console/keys").status_code == 200  # still signed in


def test_a_post_without_a_session_is_refused(console: Console) -> None:
    token = console.csrf()
    console.client.cookies.clear()
    assert console.post("/console/keys", csrf=token, id="anon").status_code == 403
    assert "anon" not in {k.id for k in run(KeyOps(console.admin.deps.keys).list())}


def test_pages_forbid_framing_scripts_and_caching(console: Console) -> None:
    for path in ("/console/keys", "/console/signin"):
        resp = console.get(path)
        assert resp.headers["x-frame-options"] == "DENY"
        assert "default-src 'none'" in resp.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in resp.headers["content-security-policy"]
        assert resp.headers["cache-control"] == "no-store"
        assert "<script" not in resp.text


def test_a_revoked_record_never_carries_a_session(console: Console) -> None:
    """Stores hand only active keys to ``by_id``; the signer refuses a revoked record anyway."""
    root = run(KeyOps(console.admin.deps.keys).get("root"))
    signer = Signer(_secret(console), 3600)
    session = signer.read(signer.issue(root))
    assert session is not None and signer.belongs(session, root)
    assert not signer.belongs(session, root.model_copy(update={"revoked": True}))
