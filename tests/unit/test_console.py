"""The operator's console (/console) over HTTP: sign-in, the key actions through the admin API's
code (same store, same audit lines), the pages, and form errors shown on the page."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from serve_app.gateway.http.api import build_api
from serve_app.gateway.keys.ops import KeyOps
from tests.keys import run
from tests.unit.console_client import Console
from tests.unit.test_admin_api import Admin


@pytest.fixture
def console(tmp_path: Path) -> Iterator[Console]:
    a = Admin(tmp_path)
    with a.client:
        yield Console(a)


def _records(c: Console) -> dict[str, object]:
    return {k.id: k for k in run(KeyOps(c.admin.deps.keys).list())}


def test_admin_key_signs_in_with_a_strict_cookie(console: Console) -> None:
    resp = console.signin(console.admin.admin)
    assert resp.status_code == 303 and resp.headers["location"] == "/console/keys"
    cookie = resp.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
    assert "Secure" not in cookie  # plain http here (the https case is below)
    assert console.admin.admin not in cookie
    page = console.get("/console/keys")
    assert page.status_code == 200 and ">root</th>" in page.text
    assert page.headers["cache-control"] == "no-store"
    assert '"action":"console.signin","target":null,"result":"ok"' in console.audit()


def test_cookie_is_secure_over_https(tmp_path: Path) -> None:
    a = Admin(tmp_path)
    with TestClient(build_api(a.deps), base_url="https://testserver") as client:
        resp = client.post("/console/signin", data={"key": a.admin}, follow_redirects=False)
        assert resp.status_code == 303 and "Secure" in resp.headers["set-cookie"]


@pytest.mark.parametrize("who", ["client", "none", "wrong"])
def test_only_an_admin_key_signs_in(console: Console, who: str) -> None:
    client_key = run(KeyOps(console.admin.deps.keys).create("app")).secret
    key = {"client": client_key, "none": None, "wrong": "sk-sa-not-a-key"}[who]
    resp = console.signin(key)
    assert resp.status_code == 401 and "set-cookie" not in resp.headers
    assert "Sign-in refused" in resp.text and 'id="key"' in resp.text  # the form again
    assert console.get("/console/keys").status_code == 303  # still signed out
    expected = '"action":"admin_denied","target":null,"result":"forbidden","route":"/console/signin"'
    if who != "client":
        expected = f'"result":"{"missing" if who == "none" else "unknown"}","route":"/console/signin"'
    assert expected in console.audit()


def test_create_rotate_revoke_go_through_the_store_and_the_audit(console: Console) -> None:
    console.signin(console.admin.admin)
    made = console.post("/console/keys", id="team-a", tier="standard", tenant="acme",
                        models="tiny-chat", budget_tokens="1000", budget_period="day",
                        expires_at="2099-01-01T00:00:00Z")
    assert made.status_code == 200, made.text
    key = _records(console)["team-a"]
    assert key.tenant == "acme" and key.models == ("tiny-chat",)  # type: ignore[attr-defined]
    assert key.budget.tokens == 1000 and key.budget.period == "day"  # type: ignore[attr-defined]
    secret = made.text.split('id="new-secret">')[1].split("<")[0]
    assert console.admin.call("GET", "/v1/models", secret).status_code == 200
    assert secret not in console.get("/console/keys").text  # shown once

    rotated = console.post("/console/keys/team-a/rotate")
    new = rotated.text.split('id="new-secret">')[1].split("<")[0]
    assert new != secret and console.admin.call("GET", "/v1/models", secret).status_code == 401
    assert console.admin.call("GET", "/v1/models", new).status_code == 200

    revoked = console.post("/console/keys/team-a/revoke")
    assert revoked.status_code == 200 and "Key team-a revoked." in revoked.text
    assert _records(console)["team-a"].revoked  # type: ignore[attr-defined]
    assert console.admin.call("GET", "/v1/models", new).status_code == 401
    log = console.audit()
    for action in ("key.create", "key.rotate", "key.revoke", "key.list"):
        assert f'"actor":"root","action":"{action}"' in log
    assert secret not in log and new not in log and console.admin.admin not in log


@pytest.mark.parametrize(("fields", "message"), [
    ({"id": "x", "budget_tokens": "lots"}, "budget.tokens: Input should be a valid integer"),
    ({"id": "x", "tier": "gold"}, "tier (&#x27;gold&#x27;) is not one of"),
    ({"id": "x", "expires_at": "tomorrow"}, "is not an ISO 8601 time"),
    ({"id": "no spaces"}, "id: String should match pattern"),
    ({"id": "root"}, "root"),  # a conflict: the store's message
])
def test_a_bad_form_value_is_shown_on_the_page(console: Console, fields: dict[str, str],
                                               message: str) -> None:
    console.signin(console.admin.admin)
    resp = console.post("/console/keys", **fields)
    assert 400 <= resp.status_code < 500 and 'class="error"' in resp.text, resp.text
    assert message in resp.text and "Traceback" not in resp.text
    assert resp.headers["content-type"].startswith("text/html")
    assert f'name="id" value="{fields["id"]}"' in resp.text  # the form is kept


def test_unknown_key_actions_are_errors_on_the_page(console: Console) -> None:
    console.signin(console.admin.admin)
    resp = console.post("/console/keys/nobody/revoke")
    assert resp.status_code == 404 and "no key with id" in resp.text
    assert console.post("/console/keys/root/explode").status_code == 404
    assert '"action":"key.revoke","target":"nobody","result":"not_found"' in console.audit()


def test_markup_in_a_tenant_or_a_form_value_is_escaped(console: Console) -> None:
    console.signin(console.admin.admin)
    evil = "<script>alert(1)</script>"
    run(KeyOps(console.admin.deps.keys).create("t1", tenant=evil))
    page = console.get("/console/keys").text
    assert evil not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    resp = console.post("/console/keys", id=evil)  # refused by the id pattern, echoed escaped
    assert resp.status_code == 400 and evil not in resp.text and "&lt;script&gt;" in resp.text
    usage = console.get("/console/usage", params={"tenant": evil})
    assert evil not in usage.text and "&lt;script&gt;" in usage.text


def test_usage_page_shows_the_admin_api_numbers(console: Console) -> None:
    from tests.unit.test_admin_api import CHAT

    key = run(KeyOps(console.admin.deps.keys).create("u1", tenant="acme")).secret
    assert console.admin.call("POST", "/v1/chat/completions", key, json=CHAT).status_code == 200
    console.signin(console.admin.admin)
    api = console.admin.call("GET", "/admin/v1/usage?tenant=acme", console.admin.admin).json()
    page = console.get("/console/usage", params={"tenant": "acme"}).text
    row = page.split('<th scope="row">u1</th>')[1].split("</tr>")[0]
    assert row == "".join(f"<td>{api['by_key']['u1'][f]}</td>"
                          for f in ("requests", "prompt_tokens", "completion_tokens"))
    bad = console.get("/console/usage", params={"period": "yesterday"})
    assert bad.status_code == 400 and "YYYY-MM" in bad.text
    assert '"action":"usage.read"' in console.audit()


def test_sla_batches_and_audit_pages(console: Console) -> None:
    console.signin(console.admin.admin)
    sla = console.get("/console/sla")
    assert sla.status_code == 200 and "needs Prometheus" in sla.text
    for tier in console.admin.deps.cfg.tiers:
        assert f'<th scope="row">{tier}</th>' in sla.text
    batches = console.get("/console/batches")
    assert batches.status_code == 200 and ("No batches." in batches.text
                                           or "Batch API is off" in batches.text)
    audit = console.get("/console/audit")
    assert audit.status_code == 200 and "console.signin" in audit.text


def test_signing_out_ends_the_session(console: Console) -> None:
    console.signin(console.admin.admin)
    resp = console.post("/console/signout")
    assert resp.status_code == 303 and resp.headers["location"] == "/console/signin"
    assert console.get("/console/keys").status_code == 303
    assert '"action":"console.signout"' in console.audit()


def test_the_session_secret_is_shared_through_the_state_dir(tmp_path: Path) -> None:
    """Two replicas over one state dir: a session of one is good on the other."""
    a = Admin(tmp_path)
    with a.client:
        Console(a).signin(a.admin)
        cookie = Console(a).cookie
    path = tmp_path / "state" / "console.secret"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with TestClient(build_api(a.deps)) as other:  # a new app: its own signer, same state dir
        other.cookies.set("serve_app_console", cookie or "", path="/console")
        assert other.get("/console/keys", follow_redirects=False).status_code == 200


def test_the_console_root_leads_to_sign_in_then_to_the_keys(console: Console) -> None:
    assert console.get("/console").headers["location"] == "/console/signin"
    console.signin(console.admin.admin)
    assert console.get("/console").headers["location"] == "/console/keys"
