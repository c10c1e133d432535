"""The API key in ``x-api-key`` (Anthropic clients, Claude Code with ANTHROPIC_API_KEY) as well as
``Authorization: Bearer``: serve_app.gateway.keys.auth.request_key, and the gateway over HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.datastructures import Headers

from serve_app.gateway.keys.auth import request_key
from tests.unit.test_api import CHAT, Env, _error


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path)
    with e.client:
        yield e


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ({"Authorization": "Bearer sk-sa-a"}, "sk-sa-a"),
        ({"x-api-key": "sk-sa-b"}, "sk-sa-b"),
        ({"X-Api-Key": "  sk-sa-b "}, "sk-sa-b"),
        # Bearer wins when both are sent; a malformed Authorization falls back to x-api-key.
        ({"Authorization": "Bearer sk-sa-a", "x-api-key": "sk-sa-b"}, "sk-sa-a"),
        ({"Authorization": "Basic dXNlcjpwYXNz", "x-api-key": "sk-sa-b"}, "sk-sa-b"),
        ({}, None),
        ({"x-api-key": ""}, None),
        ({"x-api-key": "sk-sa a"}, None),
        ({"Authorization": "Bearer"}, None),
    ],
)
def test_request_key(headers: dict[str, str], key: str | None) -> None:
    assert request_key(Headers(headers)) == key


def test_x_api_key_is_accepted(env: Env) -> None:
    resp = env.post("/v1/chat/completions", CHAT, headers={"x-api-key": env.chat_key})
    assert resp.status_code == 200, resp.text
    assert env.models.calls[0].ctx["key_id"] == "chat-only"
    models = env.client.get("/v1/models", headers={"x-api-key": env.all_key})
    assert models.status_code == 200 and models.json()["data"]


def test_wrong_x_api_key_is_401_and_not_echoed(env: Env) -> None:
    secret = "sk-sa-not-a-real-key-9876543210"
    resp = env.post("/v1/chat/completions", CHAT, headers={"x-api-key": secret})
    err = _error(resp, 401, "invalid_api_key")
    assert "9876543210" not in resp.text and err["message"] == "Incorrect API key provided."
    _error(env.post("/v1/chat/completions", CHAT, headers={"x-api-key": env.revoked_key}),
           401, "invalid_api_key")
    assert env.models.calls == []


def test_missing_key_names_both_headers(env: Env) -> None:
    err = _error(env.post("/v1/chat/completions", CHAT), 401, "invalid_api_key")
    assert "Authorization: Bearer" in err["message"] and "x-api-key" in err["message"]
