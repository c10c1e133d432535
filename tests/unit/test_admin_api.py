"""The admin API (/admin/v1) over HTTP (TestClient), on the gateway as its deployment wires it:
SQLite key store, usage, budgets and the audit log in a state dir; fake model side."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from serve_app.gateway.http.api import build_api
from serve_app.gateway.keys.ops import KeyOps
from serve_app.protocol import head, tokens_of
from tests.keys import run
from tests.unit.test_api import FakeModels, _gateway_deps

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}


class Admin:
    def __init__(self, tmp_path: Path, gateway: dict[str, Any] | None = None,
                 models: list[dict[str, Any]] | None = None, **keys: Any) -> None:
        """``keys``: the ``gateway.keys`` section's fields; ``gateway``: other gateway sections;
        ``models``: the app's models (tiny-chat alone by default; answered by ``self.models``)."""
        self.state = tmp_path / "state"
        app_config = {
            "models": models or [{"id": "tiny-chat", "source": "builtin:tiny-chat", "aliases": ["tiny"]}],
            "gateway": {"keys": {"file": str(tmp_path / "keys.yaml"), "store": "sqlite", **keys},
                        "state": {"dir": str(self.state)}, **(gateway or {})},
        }
        self.models = FakeModels()
        self.models.items = [head(200, b'{"object": "fake"}', tokens=tokens_of(10, 30))]
        self.deps = _gateway_deps(app_config, {m["id"]: self.models.handle(m["id"])
                                               for m in app_config["models"]})
        if self.deps.keys.read_only:
            self.deps.keys.read_only = False
            self.admin = run(KeyOps(self.deps.keys).create("root", role="admin")).secret
            self.deps.keys.read_only = True
        else:
            self.admin = run(KeyOps(self.deps.keys).create("root", role="admin")).secret
        self.client = TestClient(build_api(self.deps), raise_server_exceptions=False)

    def call(self, method: str, path: str, key: str | None = None, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        headers.update(kw.pop("headers", {}))
        return self.client.request(method, path, headers=headers, **kw)

    def audit(self) -> str:
        return (self.state / "audit.log").read_text()


@pytest.fixture
def admin(tmp_path: Path) -> Iterator[Admin]:
    a = Admin(tmp_path)
    with a.client:
        yield a


def _code(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert resp.json()["error"]["code"] == code


def test_create_use_rotate_revoke(admin: Admin) -> None:
    made = admin.call("POST", "/admin/v1/keys", admin.admin,
                      json={"id": "team-a", "tier": "standard", "tenant": "acme"})
    assert made.status_code == 201, made.text
    secret = made.json()["secret"]
    assert "digest" not in made.json() and made.json()["tenant"] == "acme"
    assert admin.call("GET", "/v1/models", secret).status_code == 200
    _code(admin.call("POST", "/admin/v1/keys", admin.admin, json={"id": "team-a"}), 409, "conflict")
    listed = admin.call("GET", "/admin/v1/keys", admin.admin).json()
    assert [k["id"] for k in listed["data"]] == ["root", "team-a"]
    assert secret not in str(listed)
    new = admin.call("POST", "/admin/v1/keys/team-a/rotate", admin.admin).json()["secret"]
    _code(admin.call("GET", "/v1/models", secret), 401, "invalid_api_key")
    assert admin.call("GET", "/v1/models", new).status_code == 200
    upd = admin.call("PATCH", "/admin/v1/keys/team-a", admin.admin,
                     json={"tier": "standard", "limits": {"rpm": 5}})
    assert upd.json()["limits"] == {"rpm": 5, "tpm": None, "max_concurrent": None,
                                    "max_tokens_cap": None}
    _code(admin.call("PATCH", "/admin/v1/keys/team-a", admin.admin, json={"digest": "x"}),
          400, "invalid_request")
    assert admin.call("DELETE", "/admin/v1/keys/team-a", admin.admin).json()["revoked"] is True
    _code(admin.call("GET", "/v1/models", new), 401, "invalid_api_key")
    _code(admin.call("GET", "/admin/v1/keys/nobody", admin.admin), 404, "not_found")
    log = admin.audit()
    for action in ("key.create", "key.list", "key.rotate", "key.update", "key.revoke", "auth_failed"):
        assert f'"action":"{action}"' in log
    assert secret not in log and new not in log and admin.admin not in log and "sha256" not in log


def test_roles_keep_to_their_routes(admin: Admin) -> None:
    client = admin.call("POST", "/admin/v1/keys", admin.admin, json={"id": "c"}).json()["secret"]
    _code(admin.call("GET", "/admin/v1/keys", client), 403, "permission_denied")
    _code(admin.call("GET", "/admin/v1/keys", "sk-sa-unknown"), 401, "invalid_api_key")
    _code(admin.call("GET", "/admin/v1/keys"), 401, "invalid_api_key")
    _code(admin.call("GET", "/v1/models", admin.admin), 403, "permission_denied")
    _code(admin.call("POST", "/v1/chat/completions", admin.admin, json=CHAT), 403, "permission_denied")
    assert admin.models.calls == []
    assert '"action":"admin_denied"' in admin.audit()


def test_expired_key_is_401(admin: Admin) -> None:
    past = admin.call("POST", "/admin/v1/keys", admin.admin,
                      json={"id": "old", "expires_at": "2020-01-01T00:00:00Z"}).json()
    assert past["expires_at"] == "2020-01-01T00:00:00Z"
    resp = admin.call("GET", "/v1/models", past["secret"])
    _code(resp, 401, "invalid_api_key")
    assert "expired" in resp.json()["error"]["message"]
    assert '"result":"expired"' in admin.audit()


def test_budget_spent_is_insufficient_quota(admin: Admin) -> None:
    key = admin.call("POST", "/admin/v1/keys", admin.admin,
                     json={"id": "b", "budget": {"tokens": 50, "period": "day"}}).json()["secret"]
    first = admin.call("POST", "/v1/chat/completions", key, json=CHAT)
    assert first.status_code == 200, first.text
    assert first.headers["x-budget-remaining-tokens"] == "0"  # the reservation (> 50) is held
    assert admin.call("GET", "/v1/usage", key).json()["budget"]["key"]["used"] == 40  # settled
    admin.call("POST", "/v1/chat/completions", key, json=CHAT)  # 40 < 50: admitted, now 80
    second = admin.call("POST", "/v1/chat/completions", key, json=CHAT)
    _code(second, 429, "insufficient_quota")
    assert second.json()["error"]["type"] == "insufficient_quota"
    usage = admin.call("GET", "/v1/usage", key).json()
    assert usage["budget"]["key"] == {"tokens": 50, "period": "day", "used": 80, "remaining": 0,
                                      "resets_at": usage["budget"]["key"]["resets_at"]}
    assert usage["rejections"] == {"budget": 1}
    by_key = admin.call("GET", "/admin/v1/usage?key_id=b", admin.admin).json()
    assert by_key["requests"] == 3 and set(by_key["by_key"]) == {"b"}
    assert (by_key["prompt_tokens"], by_key["completion_tokens"]) == (20, 60)
    by_model = admin.call("GET", "/admin/v1/usage?model=tiny-chat", admin.admin).json()
    assert by_model["requests"] == 2  # rejections are counted in the totals only
    _code(admin.call("GET", "/admin/v1/usage?period=yesterday", admin.admin), 400, "invalid_request")


def test_read_only_store_refuses_admin_writes(tmp_path: Path) -> None:
    a = Admin(tmp_path, read_only=True)
    with a.client:
        resp = a.call("POST", "/admin/v1/keys", a.admin, json={"id": "x"})
        _code(resp, 403, "read_only_store")
        assert a.call("GET", "/admin/v1/keys", a.admin).status_code == 200


def test_openapi_schema_of_the_admin_routes(admin: Admin) -> None:
    schema = admin.call("GET", "/admin/v1/openapi.json", admin.admin).json()
    assert {"/admin/v1/keys", "/admin/v1/keys/{key_id}", "/admin/v1/keys/{key_id}/rotate",
            "/admin/v1/usage"} <= set(schema["paths"])
    _code(admin.call("GET", "/admin/v1/openapi.json"), 401, "invalid_api_key")


def test_hostile_admin_bodies_are_4xx(admin: Admin) -> None:
    from tests.integration.fuzz_corpus import ADMIN_BODIES

    for name, body in ADMIN_BODIES.items():
        for method, path in (("POST", "/admin/v1/keys"), ("PATCH", "/admin/v1/keys/nobody")):
            resp = admin.call(method, path, admin.admin, content=body,
                              headers={"Content-Type": "application/json"})
            assert 400 <= resp.status_code < 500, (name, method, resp.text)
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert [k["id"] for k in admin.call("GET", "/admin/v1/keys", admin.admin).json()["data"]] == ["root"]
