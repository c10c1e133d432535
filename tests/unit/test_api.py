"""serve_app.gateway.api over HTTP (TestClient): real KeyStore and Router, fake model side."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from ray.serve.exceptions import BackPressureError
from starlette.responses import JSONResponse, Response

from serve_app.config import AppConfig
from serve_app.gateway.api import GatewayDeps, build_api
from serve_app.gateway.forward import Forwarder
from serve_app.gateway.keys import KeyStore, create_key, revoke_key
from serve_app.gateway.routing import Router
from serve_app.protocol import SSE_DONE, RequestContext, head

MAX_BODY = 2048
ERROR_FIELDS = {"message", "type", "param", "code"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


class FakeForwarder:
    """Records what the routes decided and answers 200 with the headers it was given."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.raise_exc: Exception | None = None

    async def forward(
        self,
        model_id: str,
        method: str,
        body: dict[str, Any],
        ctx: RequestContext,
        headers: dict[str, str],
    ) -> Response:
        if self.raise_exc is not None:
            raise self.raise_exc
        self.calls.append(
            {"model_id": model_id, "method": method, "body": body, "ctx": ctx, "headers": headers}
        )
        return JSONResponse({"object": "fake", "model_id": model_id}, headers=headers)


class Env:
    def __init__(self, tmp_path: Path, make_forwarder: Callable[[AppConfig], Any] | None = None) -> None:
        self.keys_file = tmp_path / "keys.yaml"
        self.all_key = create_key(self.keys_file, "all", "premium", ["*"])
        self.chat_key = create_key(self.keys_file, "chat-only", "standard", ["tiny-chat"])
        self.revoked_key = create_key(self.keys_file, "old", "standard", ["*"])
        revoke_key(self.keys_file, "old")
        self.cfg = AppConfig.model_validate(
            {
                "models": [
                    {"id": "tiny-chat", "source": "builtin:tiny-chat", "aliases": ["tiny"]},
                    {
                        "id": "minilm-embed",
                        "source": "x",
                        "task": "embed",
                        "aliases": ["all-minilm-l6-v2"],
                    },
                ],
                "gateway": {
                    "keys_file": str(self.keys_file),
                    "keys_reload_interval_s": 0.01,
                    "max_body_bytes": MAX_BODY,
                    "request_timeout_s": 30,
                    "retry_after_s": 3,
                },
                "tiers": {"standard": {"priority": 0}, "premium": {"priority": 5}},
            }
        )
        self.forwarder = make_forwarder(self.cfg) if make_forwarder else FakeForwarder()
        deps = GatewayDeps(
            cfg=self.cfg,
            keys=KeyStore(self.keys_file, self.cfg.gateway.keys_reload_interval_s),
            router=Router(self.cfg),
            forwarder=self.forwarder,
        )
        self.client = TestClient(build_api(deps), raise_server_exceptions=False)

    def post(self, path: str, body: Any = None, key: str | None = None, **kw: Any) -> httpx.Response:
        headers = dict(kw.pop("headers", {}))
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        if body is not None:
            kw["json"] = body
        return self.client.post(path, headers=headers, **kw)

    def get(self, path: str, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return self.client.get(path, headers=headers)


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path)
    with e.client:
        yield e


def _error(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == ERROR_FIELDS
    assert body["error"]["code"] == code
    assert body["error"]["message"]
    return body["error"]  # type: ignore[no-any-return]


# ---- health ------------------------------------------------------------------------------------
def test_health_needs_no_key(env: Env) -> None:
    resp = env.client.get("/health")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok"}


# ---- authentication ----------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
def test_missing_key_is_401(env: Env, path: str) -> None:
    err = _error(env.post(path, CHAT), 401, "invalid_api_key")
    assert "Authorization: Bearer" in err["message"]
    assert env.forwarder.calls == []


def test_models_list_needs_a_key(env: Env) -> None:
    _error(env.get("/v1/models"), 401, "invalid_api_key")


@pytest.mark.parametrize("header", ["Basic dXNlcjpwYXNz", "Bearer", "Bearer a b", "sk-sa-x"])
def test_malformed_authorization_is_401(env: Env, header: str) -> None:
    resp = env.post("/v1/chat/completions", CHAT, headers={"Authorization": header})
    err = _error(resp, 401, "invalid_api_key")
    assert "dXNlcjpwYXNz" not in resp.text
    assert err["type"] == "invalid_request_error"


def test_unknown_key_is_401_and_never_echoed(env: Env) -> None:
    secret = "sk-sa-this-is-not-a-real-key-0123456789"
    resp = env.post("/v1/chat/completions", CHAT, key=secret)
    _error(resp, 401, "invalid_api_key")
    assert secret not in resp.text
    assert "0123456789" not in resp.text
    assert all(secret not in v for v in resp.headers.values())


def test_revoked_key_is_401(env: Env) -> None:
    _error(env.post("/v1/chat/completions", CHAT, key=env.revoked_key), 401, "invalid_api_key")


def test_revocation_applies_without_restart(env: Env) -> None:
    assert env.post("/v1/chat/completions", CHAT, key=env.chat_key).status_code == 200
    revoke_key(env.keys_file, "chat-only")
    time.sleep(0.05)
    _error(env.post("/v1/chat/completions", CHAT, key=env.chat_key), 401, "invalid_api_key")


def test_auth_is_checked_before_the_body(env: Env) -> None:
    resp = env.post("/v1/chat/completions", content=b"not json", headers={"Content-Type": "text/plain"})
    _error(resp, 401, "invalid_api_key")


# ---- body checks -------------------------------------------------------------------------------
@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", None])
def test_wrong_content_type_is_415(env: Env, ctype: str | None) -> None:
    headers = {"Content-Type": ctype} if ctype else {}
    resp = env.post("/v1/chat/completions", key=env.all_key, content=b'{"model": "tiny"}', headers=headers)
    _error(resp, 415, "unsupported_media_type")
    assert env.forwarder.calls == []


def test_json_with_charset_is_accepted(env: Env) -> None:
    resp = env.post(
        "/v1/chat/completions",
        key=env.all_key,
        content=b'{"model": "tiny", "messages": []}',
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert resp.status_code == 200


def test_body_over_limit_is_413(env: Env) -> None:
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}
    err = _error(env.post("/v1/chat/completions", big, key=env.all_key), 413, "request_too_large")
    assert str(MAX_BODY) in err["message"]
    assert env.forwarder.calls == []


def test_chunked_body_over_limit_is_413(env: Env) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", "messages": "'
        for _ in range(10):
            yield b"x" * 512
        yield b'"}'

    resp = env.post(
        "/v1/chat/completions",
        key=env.all_key,
        content=chunks(),
        headers={"Content-Type": "application/json"},
    )
    _error(resp, 413, "request_too_large")


def test_malformed_json_is_400(env: Env) -> None:
    resp = env.post(
        "/v1/chat/completions",
        key=env.all_key,
        content=b'{"model": "tiny",',
        headers={"Content-Type": "application/json"},
    )
    err = _error(resp, 400, "invalid_request")
    assert "not valid JSON" in err["message"]


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"tiny"', b"3", b"null"])
def test_non_object_body_is_400(env: Env, raw: bytes) -> None:
    resp = env.post(
        "/v1/chat/completions",
        key=env.all_key,
        content=raw,
        headers={"Content-Type": "application/json"},
    )
    err = _error(resp, 400, "invalid_request")
    assert "JSON object" in err["message"]


def test_missing_model_is_400_with_param(env: Env) -> None:
    err = _error(env.post("/v1/chat/completions", {"messages": []}, key=env.all_key), 400, "invalid_request")
    assert err["param"] == "model"


# ---- routing -----------------------------------------------------------------------------------
def test_unknown_model_is_404(env: Env) -> None:
    body = {**CHAT, "model": "gpt-4o"}
    err = _error(env.post("/v1/chat/completions", body, key=env.all_key), 404, "model_not_found")
    assert err["param"] == "model"


def test_restricted_key_gets_404_for_other_models(env: Env) -> None:
    body = {"model": "minilm-embed", "input": "hi"}
    _error(env.post("/v1/embeddings", body, key=env.chat_key), 404, "model_not_found")
    assert env.post("/v1/embeddings", body, key=env.all_key).status_code == 200


def test_endpoint_must_match_model_task(env: Env) -> None:
    err = _error(
        env.post("/v1/embeddings", {"model": "tiny", "input": "hi"}, key=env.all_key),
        400,
        "invalid_request",
    )
    assert err["param"] == "model"
    err = _error(
        env.post("/v1/chat/completions", {**CHAT, "model": "all-minilm-l6-v2"}, key=env.all_key),
        400,
        "invalid_request",
    )
    assert err["param"] == "model"
    assert env.forwarder.calls == []


def test_unknown_path_is_404(env: Env) -> None:
    err = _error(env.post("/v1/chat/complete", CHAT, key=env.all_key), 404, "not_found")
    assert err["message"] == "Unknown path."


def test_wrong_method_is_405(env: Env) -> None:
    _error(env.get("/v1/chat/completions", key=env.all_key), 405, "method_not_allowed")


@pytest.mark.xfail(
    strict=True,
    reason="bug: api.install_error_handlers.on_http_error rebuilds the error without Starlette's "
    "HTTPException.headers, so a 405 loses the 'Allow' header that RFC 9110 requires",
)
def test_wrong_method_names_allowed_methods(env: Env) -> None:
    resp = env.get("/v1/chat/completions", key=env.all_key)
    assert resp.status_code == 405
    assert resp.headers.get("allow") == "POST"


# ---- forwarding --------------------------------------------------------------------------------
def test_alias_is_forwarded_to_its_model_with_context(env: Env) -> None:
    t0 = time.time()
    resp = env.post(
        "/v1/chat/completions", CHAT, key=env.all_key, headers={"X-Request-Id": "client-42"}
    )
    assert resp.status_code == 200
    assert resp.headers["x-served-by"] == "tiny-chat"
    assert resp.headers["x-request-id"] == "client-42"
    (call,) = env.forwarder.calls
    assert (call["model_id"], call["method"]) == ("tiny-chat", "chat")
    assert call["body"] == CHAT  # the body reaches the model unchanged
    ctx = call["ctx"]
    assert (ctx.key_id, ctx.tier, ctx.priority) == ("all", "premium", 5)
    assert t0 + 29 < ctx.deadline < time.time() + 31


@pytest.mark.parametrize(
    ("path", "body", "method"),
    [
        ("/v1/completions", {"model": "tiny-chat", "prompt": "hi"}, "completions"),
        ("/v1/embeddings", {"model": "all-minilm-l6-v2", "input": "hi"}, "embeddings"),
    ],
)
def test_each_endpoint_calls_its_method(env: Env, path: str, body: dict[str, Any], method: str) -> None:
    assert env.post(path, body, key=env.all_key).status_code == 200
    assert env.forwarder.calls[0]["method"] == method


@pytest.mark.parametrize("given", ["x" * 200, "has space", "semi;colon"])
def test_unsafe_request_id_is_replaced(env: Env, given: str) -> None:
    resp = env.post("/v1/chat/completions", CHAT, key=env.all_key, headers={"X-Request-Id": given})
    assert resp.status_code == 200
    rid = resp.headers["x-request-id"]
    assert rid != given and len(rid) == 32


def test_unexpected_error_is_500_without_details(env: Env) -> None:
    env.forwarder.raise_exc = RuntimeError("secret detail /etc/passwd")
    resp = env.post("/v1/chat/completions", CHAT, key=env.all_key)
    _error(resp, 500, "internal_error")
    assert "secret detail" not in resp.text and "/etc/passwd" not in resp.text


# ---- model listing -----------------------------------------------------------------------------
def test_models_list_is_filtered_per_key(env: Env) -> None:
    all_ids = {m["id"] for m in env.get("/v1/models", env.all_key).json()["data"]}
    assert all_ids == {"tiny-chat", "tiny", "minilm-embed", "all-minilm-l6-v2"}
    chat = env.get("/v1/models", env.chat_key).json()
    assert chat["object"] == "list"
    assert {m["id"] for m in chat["data"]} == {"tiny-chat", "tiny"}


def test_model_card_for_alias_names_its_root(env: Env) -> None:
    card = env.get("/v1/models/tiny", env.all_key).json()
    assert card["id"] == "tiny" and card["object"] == "model"
    assert card["root"] == "tiny-chat" and card["parent"] == "tiny-chat"
    assert isinstance(card["created"], int)
    base = env.get("/v1/models/tiny-chat", env.all_key).json()
    assert base["parent"] is None


def test_model_card_hidden_from_restricted_key(env: Env) -> None:
    _error(env.get("/v1/models/minilm-embed", env.chat_key), 404, "model_not_found")


# ---- with the real Forwarder and fake deployment handles ---------------------------------------
class _Gen:
    def __init__(self, items: list[Any]) -> None:
        self.items = items

    async def __anext__(self) -> Any:
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        pass


class _Handle:
    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def options(self, **kw: Any) -> _Handle:
        assert kw == {"stream": True}
        return self

    def __getattr__(self, method: str) -> Any:
        handle = self

        class _M:
            @staticmethod
            def remote(body: dict[str, Any], ctx: dict[str, Any]) -> _Gen:
                return _Gen(list(handle.items))

        return _M


def _real_env(tmp_path: Path, items: list[Any]) -> Env:
    def make(cfg: AppConfig) -> Forwarder:
        return Forwarder({m.id: _Handle(items) for m in cfg.models}, cfg.gateway)

    return Env(tmp_path, make)


def test_stream_is_relayed_as_event_stream(tmp_path: Path) -> None:
    env = _real_env(
        tmp_path, [head(200, b"data: {\"n\": 1}\n\n", stream=True), b"data: {\"n\": 2}\n\n", SSE_DONE]
    )
    resp = env.post("/v1/chat/completions", {**CHAT, "stream": True}, key=env.all_key)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["x-served-by"] == "tiny-chat"
    assert resp.content == b'data: {"n": 1}\n\ndata: {"n": 2}\n\n' + SSE_DONE


def test_model_error_head_is_passed_through(tmp_path: Path) -> None:
    body = b'{"error": {"message": "too long", "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}'
    env = _real_env(tmp_path, [head(400, body)])
    resp = env.post("/v1/chat/completions", CHAT, key=env.all_key)
    _error(resp, 400, "context_length_exceeded")


def test_backpressure_is_503_with_retry_after(tmp_path: Path) -> None:
    env = _real_env(tmp_path, [BackPressureError(num_queued_requests=4, max_queued_requests=4)])
    resp = env.post("/v1/chat/completions", CHAT, key=env.all_key)
    err = _error(resp, 503, "service_unavailable")
    assert err["type"] == "server_error"
    assert resp.headers["retry-after"] == "3"
