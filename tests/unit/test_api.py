"""serve_app.gateway.http.api over HTTP (TestClient): real key store and Router, fake model side."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from serve_app.errors import error_body
from serve_app.gateway.deployment import Gateway
from serve_app.gateway.forward import Forwarder
from serve_app.gateway.http.api import GatewayDeps, build_api
from serve_app.gateway.routing.router import Router
from serve_app.protocol import SSE_DONE, head
from serve_app.state.keys import FileKeyStore
from tests.keys import create_key, file_store, loaded, revoke_key, run
from tests.unit.fakes import Call, FakeClient, FakeStream, StepClock

MAX_BODY = 2048
ERROR_FIELDS = {"message", "type", "param", "code"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
OK_BODY = b'{"object": "fake"}'


class FakeModels:
    """Fake model clients for every model: one call log in order, each call answered with
    ``self.items``."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.items: list[Any] = [head(200, OK_BODY)]

    def handle(self, model_id: str) -> FakeClient:
        return FakeClient(lambda: FakeStream(self.items), model_id, self.calls)


def _gateway_deps(app_config: dict[str, Any], clients: dict[str, Any]) -> GatewayDeps:
    """The deps exactly as the Gateway deployment wires them, without starting Ray Serve; the
    models' ``DirectClient``s (``Gateway._clients``) replaced by ``clients``."""
    # Gateway.func_or_class is wrapped by @serve.ingress, whose __init__ needs a Serve replica;
    # the class's own constructor is the one that builds GatewayDeps.
    own = next(
        c
        for c in Gateway.func_or_class.__mro__
        if getattr(vars(c).get("__init__"), "__qualname__", "") == "Gateway.__init__"
    )
    obj = object.__new__(own)
    obj._clients = lambda cfg, outage: dict(clients)
    # The constructor is async for Ray Serve, and awaits nothing: one step runs it to the end,
    # inside a loop or not.
    step = own.__init__(obj, app_config, {})
    with pytest.raises(StopIteration):
        step.send(None)
    deps = obj.deps
    assert isinstance(deps, GatewayDeps)
    loaded(deps.keys)  # as the replica's start does (its lifespan), before it serves
    return deps


class Env:
    def __init__(self, tmp_path: Path) -> None:
        self.keys_file = tmp_path / "keys.yaml"
        self.all_key = create_key(self.keys_file, "all", "premium", ["*"])
        self.chat_key = create_key(self.keys_file, "chat-only", "standard", ["tiny-chat"])
        self.revoked_key = create_key(self.keys_file, "old", "standard", ["*"])
        revoke_key(self.keys_file, "old")
        app_config = {
            "models": [
                {"id": "tiny-chat", "source": "builtin:tiny-chat", "aliases": ["tiny"],
                 "engine": {"max_model_len": 4096},
                 "frontend": {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}},
                {"id": "minilm-embed", "source": "x", "task": "embed", "aliases": ["all-minilm-l6-v2"]},
            ],
            "gateway": {
                "keys": {"file": str(self.keys_file), "reload_interval_s": 1.0},
                "http": {"max_body_bytes": MAX_BODY, "request_timeout_s": 30, "retry_after_s": 3},
            },
            "tiers": {"standard": {"priority": 0},
                      "premium": {"priority": 5, "key_limits": {"rpm": 1000, "tpm": 1_000_000}}},
        }
        self.models = FakeModels()
        handles = {m["id"]: self.models.handle(m["id"]) for m in app_config["models"]}
        deps = _gateway_deps(app_config, handles)
        # Real key store, Router and Forwarder; only the model deployments are fake.
        assert isinstance(deps.keys, FileKeyStore) and isinstance(deps.router, Router)
        assert isinstance(deps.pipeline.forwarder, Forwarder)
        self.keys_clock = StepClock()  # the same key store, on a clock the test steps
        deps.keys = file_store(deps.keys.path, deps.keys.interval_s, clock=self.keys_clock)
        self.keys = deps.keys
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
    assert env.models.calls == []


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
    env.keys_clock.step(1.0)
    run(env.keys.refresh())  # the replica's poll (keep_fresh)
    _error(env.post("/v1/chat/completions", CHAT, key=env.chat_key), 401, "invalid_api_key")


def test_auth_is_checked_before_the_body(env: Env) -> None:
    resp = env.post("/v1/chat/completions", content=b"not json", headers={"Content-Type": "text/plain"})
    _error(resp, 401, "invalid_api_key")


# ---- body checks -------------------------------------------------------------------------------
@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", None])
def test_wrong_content_type_is_415(env: Env, ctype: str | None) -> None:
    headers = {"Content-Type": ctype} if ctype else {}
    resp = env.post(
        "/v1/chat/completions", key=env.all_key, content=b'{"model": "tiny"}', headers=headers
    )
    _error(resp, 415, "unsupported_media_type")
    assert env.models.calls == []


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
    assert env.models.calls == []


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
    resp = env.post("/v1/chat/completions", {"messages": []}, key=env.all_key)
    err = _error(resp, 400, "invalid_request")
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
    assert env.models.calls == []


def test_unknown_path_is_404(env: Env) -> None:
    err = _error(env.post("/v1/chat/complete", CHAT, key=env.all_key), 404, "not_found")
    assert err["message"] == "Unknown path."


def test_wrong_method_is_405(env: Env) -> None:
    _error(env.get("/v1/chat/completions", key=env.all_key), 405, "method_not_allowed")


def test_wrong_method_names_allowed_methods(env: Env) -> None:
    resp = env.get("/v1/chat/completions", key=env.all_key)
    assert resp.status_code == 405
    assert resp.headers.get("allow") == "POST"


# ---- forwarding --------------------------------------------------------------------------------
def test_alias_is_forwarded_to_its_model_with_context(env: Env) -> None:
    t0 = time.time()
    resp = env.post("/v1/chat/completions", CHAT, key=env.all_key)
    assert resp.status_code == 200
    assert resp.headers["x-served-by"] == "tiny-chat"
    (call,) = env.models.calls
    assert (call.model_id, call.endpoint) == ("tiny-chat", "chat")
    assert call.body == CHAT  # the body reaches the model unchanged
    ctx = call.ctx  # plain data crosses the handle
    assert (ctx["key_id"], ctx["tier"], ctx["priority"]) == ("all", "premium", 5)
    assert t0 + 29 < ctx["deadline"] < time.time() + 31
    assert resp.content == OK_BODY


def test_session_header_becomes_the_affinity_key(env: Env) -> None:
    """The gateway's picker reads ctx["affinity"] (gateway/routing/placement.py): one session, one key, whatever
    the turn's messages; another session, another key."""
    sid = {"X-Claude-Code-Session-Id": "s-1"}
    env.post("/v1/chat/completions", CHAT, key=env.all_key, headers=sid)
    turn2 = {**CHAT, "messages": [*CHAT["messages"], {"role": "user", "content": "more"}]}
    env.post("/v1/chat/completions", turn2, key=env.all_key, headers=sid)
    env.post("/v1/chat/completions", CHAT, key=env.all_key,
             headers={"X-Claude-Code-Session-Id": "s-2"})
    one, two, other = (c.ctx["affinity"] for c in env.models.calls)
    assert one == two != other and len(one) == 32


@pytest.mark.parametrize(
    ("path", "body", "method"),
    [
        ("/v1/completions", {"model": "tiny-chat", "prompt": "hi"}, "completions"),
        ("/v1/embeddings", {"model": "all-minilm-l6-v2", "input": "hi"}, "embeddings"),
    ],
)
def test_each_endpoint_calls_its_method(env: Env, path: str, body: dict[str, Any], method: str) -> None:
    assert env.post(path, body, key=env.all_key).status_code == 200
    assert env.models.calls[0].endpoint == method


def test_unexpected_error_is_500_without_details(env: Env) -> None:
    env.models.items = [RuntimeError("secret detail /etc/passwd")]
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


def test_model_cards_tell_the_models_limits_and_the_keys(env: Env) -> None:
    """A client sizes its context and output by the listing instead of guessing."""
    cards = {m["id"]: m for m in env.get("/v1/models", env.all_key).json()["data"]}
    chat, embed = cards["tiny"], cards["minilm-embed"]
    assert chat["max_model_len"] == 4096 and chat["max_output_tokens"] == 4096  # no cap: the context
    assert chat["modalities"] == {"input": ["text"], "output": ["text"]}
    assert chat["supports_tools"] is True  # a tool parser is configured
    assert chat["limits"] == {"tier": "premium", "rpm": 1000, "tpm": 1_000_000,
                              "max_concurrent": None, "max_tokens_cap": None}
    assert embed["max_model_len"] is None and embed["max_output_tokens"] is None
    assert embed["modalities"] == {"input": ["text"], "output": ["embeddings"]}
    assert embed["supports_tools"] is False
    standard = env.get("/v1/models/tiny-chat", env.chat_key).json()
    assert standard["limits"]["tier"] == "standard" and standard["limits"]["rpm"] is None


def test_an_anthropic_client_gets_anthropics_listing(env: Env) -> None:
    headers = {"x-api-key": env.all_key, "anthropic-version": "2023-06-01"}
    first = env.client.get("/v1/models?limit=3", headers=headers).json()
    assert set(first) == {"data", "has_more", "first_id", "last_id"}
    assert [set(m) for m in first["data"]] == [{"type", "id", "display_name", "created_at"}] * 3
    assert first["data"][0]["type"] == "model"
    assert first["data"][0]["display_name"] == first["data"][0]["id"] == first["first_id"]
    assert first["data"][0]["created_at"].endswith("Z")
    assert first["has_more"] is True and first["last_id"] == first["data"][-1]["id"]
    rest = env.client.get(f"/v1/models?limit=3&after_id={first['last_id']}", headers=headers).json()
    assert rest["has_more"] is False and len(rest["data"]) == 1
    listed = {m["id"] for m in first["data"] + rest["data"]}
    assert listed == {"tiny-chat", "tiny", "minilm-embed", "all-minilm-l6-v2"}
    one = env.client.get("/v1/models/tiny", headers=headers).json()
    assert one == {"type": "model", "id": "tiny", "display_name": "tiny",
                   "created_at": first["data"][0]["created_at"]}
    bad = env.client.get("/v1/models?after_id=nope", headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after_id"


# ---- model answers relayed by the real Forwarder ----------------------------------------------
def test_stream_is_relayed_as_event_stream(env: Env) -> None:
    env.models.items = [
        head(200, b'data: {"n": 1}\n\n', stream=True),
        (b'data: {"n": 2}\n\n', 2),
        (SSE_DONE, 2),
    ]
    resp = env.post("/v1/chat/completions", {**CHAT, "stream": True}, key=env.all_key)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["x-served-by"] == "tiny-chat"
    assert resp.content == b'data: {"n": 1}\n\ndata: {"n": 2}\n\n' + SSE_DONE


def test_model_error_head_is_passed_through(env: Env) -> None:
    body = error_body("too long", "invalid_request_error", "messages", "context_length_exceeded")
    env.models.items = [head(400, json.dumps(body).encode())]
    resp = env.post("/v1/chat/completions", CHAT, key=env.all_key)
    _error(resp, 400, "context_length_exceeded")


def test_unreachable_model_is_503_with_retry_after(env: Env) -> None:
    env.models.items = [ConnectionRefusedError()]  # no replica took it: nothing ran
    resp = env.post("/v1/chat/completions", CHAT, key=env.all_key)
    err = _error(resp, 503, "service_unavailable")
    assert err["type"] == "server_error"
    assert resp.headers["retry-after"] == "3"  # the gateway's retry_after_s
    # Admitted, then refused by the model: the answer still tells the key's limits.
    assert resp.headers["x-ratelimit-limit-requests"] == "1000"
    assert resp.headers["x-ratelimit-remaining-requests"] == "999"


def test_anthropic_limit_headers_only_on_the_messages_routes(env: Env) -> None:
    messages = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    for path, body in (("/v1/messages", messages), ("/v1/messages/count_tokens", messages),
                       ("/v1/chat/completions", CHAT)):
        resp = env.post(path, body, key=env.all_key)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-ratelimit-limit-tokens"] == "1000000"
        anthropic = {h for h in resp.headers if h.startswith("anthropic-ratelimit-")}
        assert anthropic == ({f"anthropic-ratelimit-{kind}-{part}" for kind in ("requests", "tokens")
                              for part in ("limit", "remaining", "reset")}
                             if path.startswith("/v1/messages") else set()), path
