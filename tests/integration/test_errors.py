"""Every error case answers with an OpenAI-shaped body and the right status, through the real stack."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _post(stack, path: str, *, key: str | None = "all", **kw) -> httpx.Response:
    headers = kw.pop("headers", {})
    if key is not None:
        headers["Authorization"] = f"Bearer {stack.keys[key]}"
    return httpx.post(f"{stack.base_url}{path}", headers=headers, timeout=60, **kw)


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_missing_and_unknown_keys_are_401(stack) -> None:
    r = _post(stack, "/chat/completions", key=None, json=CHAT)
    assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key"
    bogus = "sk-sa-this-is-not-a-real-key-0123456789"
    r = _post(stack, "/chat/completions", key=None, json=CHAT,
              headers={"Authorization": f"Bearer {bogus}"})
    assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key"
    assert bogus not in r.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.base_url, api_key=bogus, max_retries=0).models.list()


def test_unknown_and_forbidden_models_are_404(stack) -> None:
    r = _post(stack, "/chat/completions", json={**CHAT, "model": "gpt-17"})
    err = _error(r)
    assert r.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model"
    # The embed-only key may not see tiny-chat: same answer as for a model that does not exist.
    r = _post(stack, "/chat/completions", key="embed-only", json=CHAT)
    err = _error(r)
    assert r.status_code == 404 and err["code"] == "model_not_found"
    assert "minilm" not in err["message"]
    c = openai.OpenAI(base_url=stack.base_url, api_key=stack.keys["embed-only"], max_retries=0)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(**CHAT)


def test_bad_parameters_are_400_with_param(stack) -> None:
    r = _post(stack, "/chat/completions", json={**CHAT, "temperature": "hot"})
    assert r.status_code == 400 and _error(r)["param"] == "temperature"
    r = _post(stack, "/chat/completions", json={**CHAT, "messages": "not a list"})
    assert r.status_code == 400 and _error(r)["param"] == "messages"
    r = _post(stack, "/chat/completions", json={k: v for k, v in CHAT.items() if k != "model"})
    assert r.status_code == 400 and _error(r)["param"] == "model"
    r = _post(stack, "/embeddings", json={"model": "tiny-chat", "input": "x"})
    assert r.status_code == 400 and _error(r)["param"] == "model"


def test_malformed_json_is_400(stack) -> None:
    r = _post(stack, "/chat/completions", content=b'{"model": ', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and _error(r)["code"] == "invalid_request"
    r = _post(stack, "/chat/completions", content=b"[1, 2]", headers={"Content-Type": "application/json"})
    assert r.status_code == 400


def test_context_length_exceeded(stack) -> None:
    from tests.integration.conftest import MAX_MODEL_LEN

    # Each CJK character is 3 byte-level tokens of tiny-chat's tokenizer: over the context in a
    # body well under the gateway's size limit.
    long = "\u4e2d" * (MAX_MODEL_LEN // 2)
    r = _post(stack, "/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": long}]})
    err = _error(r)
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["param"] == "messages"
    r = _post(stack, "/completions", json={"model": "tiny-chat", "prompt": long, "max_tokens": 4})
    assert r.status_code == 400 and _error(r)["code"] == "context_length_exceeded"


def test_body_too_large_is_413_and_wrong_type_is_415(stack) -> None:
    from tests.integration.conftest import MAX_BODY_BYTES

    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (MAX_BODY_BYTES + 10)}]}
    r = _post(stack, "/chat/completions", json=big)
    assert r.status_code == 413 and _error(r)["type"] == "invalid_request_error"
    r = _post(stack, "/chat/completions", content=json.dumps(CHAT), headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and _error(r)["code"] == "unsupported_media_type"


def test_unknown_path_and_method(stack) -> None:
    r = httpx.get(f"{stack.base_url}/nothing-here", timeout=10)
    assert r.status_code == 404 and _error(r)
    r = httpx.get(f"{stack.base_url}/chat/completions", timeout=10,
                  headers={"Authorization": f"Bearer {stack.keys['all']}"})
    assert r.status_code == 405 and _error(r)


def test_health_needs_no_key(stack) -> None:
    r = httpx.get(f"{stack.root_url}/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_back_pressure_is_503_with_retry_after(stack) -> None:
    """More concurrent streams than max_ongoing + max_queued: the excess gets 503 + Retry-After."""
    from tests.integration.conftest import MAX_ONGOING, MAX_QUEUED

    async def one(client: httpx.AsyncClient) -> httpx.Response:
        # ignore_eos: every stream really holds its slot for 300 tokens (random weights may stop early).
        body = {**CHAT, "max_tokens": 300, "stream": True, "ignore_eos": True}
        async with client.stream("POST", "/chat/completions", json=body) as r:
            await r.aread()
            return r

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=stack.base_url, timeout=120,
            headers={"Authorization": f"Bearer {stack.keys['all']}"},
            limits=httpx.Limits(max_connections=100),
        ) as client:
            return await asyncio.gather(*[one(client) for _ in range(2 * (MAX_ONGOING + MAX_QUEUED))])

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}, codes
    rejected = [r for r in responses if r.status_code == 503]
    assert rejected, "no request was shed"
    assert codes.count(200) >= MAX_ONGOING
    for r in rejected:
        assert int(r.headers["retry-after"]) >= 1
        err = _error(r)
        assert err["code"] == "model_at_capacity" and "at capacity" in err["message"], err
    for r in responses:
        if r.status_code == 200:
            assert r.text.rstrip().endswith("data: [DONE]")
