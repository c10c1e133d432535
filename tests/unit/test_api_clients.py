"""The gateway's routes for coding agents over HTTP (TestClient, fake model side): Anthropic's
envelope on the Messages API routes, the Responses API, the root probe, ?limit=."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_app import errors
from serve_app.protocol import ENDPOINTS
from tests.unit.test_api import Env, _error


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path)
    with e.client:
        yield e

MSG = {"model": "tiny-chat", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages?beta=true", "/v1/messages/count_tokens"])
def test_messages_routes_answer_errors_in_anthropics_envelope(env: Env, path: str) -> None:
    r = env.post(path, MSG, headers={"x-api-key": "sk-sa-wrong"})
    assert r.status_code == 401
    assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                   "message": "Incorrect API key provided."}}
    r = env.post(path, {**MSG, "model": "nope"}, headers={"x-api-key": env.all_key})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = env.post(path, {**MSG, "model": "minilm-embed"}, headers={"x-api-key": env.all_key})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert env.models.calls == []


def test_messages_reach_the_model_with_anthropic_headers(env: Env) -> None:
    r = env.post("/v1/messages?beta=true", MSG, headers={
        "x-api-key": env.chat_key, "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219"})
    assert r.status_code == 200, r.text
    call = env.models.calls[0]
    assert call.endpoint == "messages" and call.body["max_tokens"] == 8
    assert call.ctx["key_id"] == "chat-only"


def test_openai_routes_keep_openais_envelope(env: Env) -> None:
    _error(env.post("/v1/chat/completions", {"model": "tiny"}, headers={"x-api-key": "sk-sa-x"}),
           401, "invalid_api_key")


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"previous_response_id": "resp_1"}, "previous_response_id"), ({"background": True}, "background")],
)
def test_a_batch_line_refuses_server_side_state(extra: dict, param: str) -> None:
    """A batch line is never stored: what needs a stored response is refused (the HTTP route
    stores them: test_stored_responses.py)."""
    check = ENDPOINTS["responses"].body_check
    assert check is not None
    with pytest.raises(errors.InvalidRequest) as exc:
        check({"model": "tiny-chat", "input": "hi", **extra})
    assert exc.value.param == param


def test_responses_stateless_is_forwarded(env: Env) -> None:
    r = env.post("/v1/responses", {"model": "tiny", "input": "hi", "store": False}, key=env.all_key)
    assert r.status_code == 200, r.text
    assert env.models.calls[0].model_id == "tiny-chat"


def test_root_answers_get_and_head_without_a_key(env: Env) -> None:
    assert env.client.get("/").status_code == 200
    assert env.client.head("/").status_code == 200


def test_models_limit(env: Env) -> None:
    headers = {"x-api-key": env.all_key}
    every = env.client.get("/v1/models?limit=1000", headers=headers).json()["data"]
    one = env.client.get("/v1/models?limit=1", headers=headers).json()["data"]
    assert len(every) > 1 and one == every[:1]
    err = _error(env.client.get("/v1/models?limit=0", headers=headers), 400, "invalid_request")
    assert err["param"] == "limit"


def test_every_endpoint_has_a_route(env: Env) -> None:
    for endpoint in ENDPOINTS.values():
        r = env.post(endpoint.path, {"model": "nope"}, key=env.all_key)
        assert r.status_code == 404, (endpoint.path, r.text)  # the model, not the path, is unknown
        body = r.json()
        assert (body["error"]["type"] == "not_found_error") == (endpoint.dialect == "anthropic")
