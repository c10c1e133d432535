"""The specific hostile inputs of issue 15, through the real front door: each gets a 4xx in the
OpenAI shape naming the field (or a 200 where plain vLLM answers 200), fast, and leaves no request
unfinished in the engine."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import pytest

from serve_app.local.front_door import HTTP_REQUEST_TIMEOUT_S
from serve_app.protocol import RequestContext
from tests.integration.rawhttp import RawResponse, request, send

pytestmark = pytest.mark.integration

CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
FOUR_MIB = 4 * 1024 * 1024


def _hostport(stack) -> tuple[str, int]:
    url = urlsplit(stack.base_url)
    return url.hostname or "127.0.0.1", url.port or 80


def _raw(stack, data: bytes, timeout_s: float = 30.0) -> RawResponse:
    return send(*_hostport(stack), data, timeout_s=timeout_s)


def _post_raw(stack, path: str, body: bytes) -> RawResponse:
    return _raw(stack, request("POST", path, body=body, headers={
        "Authorization": f"Bearer {stack.keys['all']}", "Content-Type": "application/json"}))


def _error(r: RawResponse | httpx.Response, status: int) -> dict:
    assert r.status_code == status if isinstance(r, httpx.Response) else r.status == status, (
        r.status_code if isinstance(r, httpx.Response) else r.status, r.text[:300])
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _unfinished(serve_handles) -> int:
    return serve_handles("model-tiny-chat").stats.remote().result(timeout_s=30)["unfinished_requests"]


def test_deep_json_and_lone_surrogates_are_400_naming_the_field(stack) -> None:
    deep = b'{"model": "tiny-chat", "max_tokens": 2, "messages": ' + b"[" * 300 + b"]" * 300 + b"}"
    t0 = time.monotonic()
    assert _error(_post_raw(stack, "/v1/chat/completions", deep), 400)["param"] == "messages"
    whole = b"[" * 20000 + b"]" * 20000
    _error(_post_raw(stack, "/v1/chat/completions", whole), 400)
    for field, value in (("model", '"\\ud800"'), ("stop", '["ok", "\\udfff"]'), ("user", '"a\\udc00"')):
        body = json.dumps(CHAT)[:-1] + f', "{field}": {value}}}'
        if field == "model":
            body = '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'
        assert _error(_post_raw(stack, "/v1/chat/completions", body.encode()), 400)["param"] == field
    for value in ("NaN", "Infinity", str(2**70)):
        body = json.dumps(CHAT)[:-1] + f', "temperature": {value}}}'
        assert _error(_post_raw(stack, "/v1/chat/completions", body.encode()), 400)["param"] == "temperature"
    assert time.monotonic() - t0 < 10


def _model_call(serve_handles, endpoint: str, body: dict, ctx: dict,
                token: str | None = None) -> dict | None:
    """The head of one request sent to the tiny-chat replica's endpoint in the gateway's frames
    (the JSON written by the standard library, which writes what the gateway never would), or
    None if the replica hung up without answering."""
    import asyncio

    import ray

    from serve_app import wire
    from serve_app.config import APP_NAME
    from serve_app.runtime.registry import NAMESPACE, actor_name

    host, port = serve_handles("model-tiny-chat").stats.remote().result(timeout_s=30)["endpoint"].rsplit(":", 1)
    if token is None:
        token = ray.get(ray.get_actor(actor_name(APP_NAME), namespace=NAMESPACE).token.remote())

    async def call() -> dict | None:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(wire.frame(wire.REQUEST, json.dumps(
            {"token": token, "endpoint": endpoint, "body": body, "ctx": ctx}).encode()))
        try:
            kind, payload = await wire.read_frame(reader)
        except asyncio.IncompleteReadError:
            return None
        finally:
            writer.close()
            await writer.wait_closed()
        assert kind != wire.REFUSED, f"refused: {payload!r}"
        return wire.decode(kind, payload)

    return asyncio.run(call())


def test_engine_refuses_what_vllm_would_leak_and_nothing_stays_unfinished(stack, serve_handles) -> None:
    auth = {"Authorization": f"Bearer {stack.keys['all']}"}
    r = httpx.post(f"{stack.base_url}/chat/completions", headers=auth, timeout=30,
                   json={**CHAT, "structured_outputs": "not an object"})
    assert _error(r, 400)["param"] == "structured_outputs"
    r = httpx.post(f"{stack.base_url}/chat/completions", timeout=30,
                   headers={**auth, "Content-Type": "application/json"},
                   content=json.dumps(CHAT)[:-1] + f', "top_k": {2**70}}}')
    assert _error(r, 400)["param"] == "top_k"
    r = httpx.post(f"{stack.base_url}/chat/completions", headers=auth, timeout=30,
                   json={**CHAT, "top_k": 2**40})
    assert _error(r, 400)["param"] == "top_k"
    # Straight to the model replica's own endpoint (no gateway parsing in front): its own checks
    # answer; a lone surrogate is not even read (the frame's JSON parser refuses it and the
    # replica hangs up). Without the app's token it answers nothing at all.
    ctx = RequestContext("hostile-1", "k", "premium").to_dict()
    for field, value in (("top_k", 2**70), ("structured_outputs", 3)):
        first = _model_call(serve_handles, "chat", {**CHAT, field: value}, ctx)
        assert first is not None and first["status"] == 400, (field, first)
        assert json.loads(first["body"])["error"]["param"] == field
    assert _model_call(serve_handles, "chat", {**CHAT, "stop": ["\ud800"]}, ctx) is None
    with pytest.raises(AssertionError, match="refused"):
        _model_call(serve_handles, "chat", CHAT, ctx, token="not-the-token")
    deadline = time.monotonic() + 5
    while _unfinished(serve_handles) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _unfinished(serve_handles) == 0


def test_answers_over_4_mib_arrive_whole(stack) -> None:
    auth = {"Authorization": f"Bearer {stack.keys['all']}"}
    inputs = [f"input number {i} of a large batch" for i in range(1024)]
    r = httpx.post(f"{stack.base_url}/embeddings", headers=auth, timeout=120,
                   json={"model": "minilm-embed", "input": inputs})
    assert r.status_code == 200, r.text[:300]
    assert len(r.content) > FOUR_MIB
    assert [d["index"] for d in r.json()["data"]] == list(range(1024))
    body = {**CHAT, "n": 3, "max_tokens": 1500, "ignore_eos": True, "logprobs": True, "top_logprobs": 20}
    r = httpx.post(f"{stack.base_url}/chat/completions", headers=auth, timeout=300, json=body)
    assert r.status_code == 200, r.text[:300]
    assert len(r.content) > FOUR_MIB
    answer = r.json()
    assert len(answer["choices"]) == 3 and answer["usage"]["completion_tokens"] == 4500
    print(f"\n[hostile] embeddings 1024: 200; chat n=3 logprobs: 200, {len(r.content) / 2**20:.1f} MiB")


def test_an_answer_too_large_to_send_is_refused_before_the_work(stack) -> None:
    auth = {"Authorization": f"Bearer {stack.keys['all']}"}
    t0 = time.monotonic()
    r = httpx.post(f"{stack.base_url}/chat/completions", headers=auth, timeout=30, json={
        **CHAT, "n": 128, "max_tokens": 60000, "logprobs": True, "top_logprobs": 20})
    assert _error(r, 400)["param"] in ("max_tokens", "n")
    assert time.monotonic() - t0 < 5


def test_front_door_answers_malformed_http_in_json(stack) -> None:
    key = stack.keys["all"]
    auth = [("Authorization", f"Bearer {key}")]
    cases = {
        "FOO": request("FOO", "/v1/models", headers=auth),
        "CONNECT": b"CONNECT 127.0.0.1:443 HTTP/1.1\r\nHost: 127.0.0.1:443\r\n\r\n",
        "OPTIONS *": b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "TRACE": request("TRACE", "/", headers=auth),
    }
    for name, data in cases.items():
        r = _raw(stack, data)
        assert r.status in (400, 405), (name, r.status, r.raw[:200])
        _error(r, r.status)
        assert key not in r.raw.decode("latin-1")
    # Refused by HAProxy's parser: a 400 either way, JSON where its errorfiles apply (README).
    for name, data in {
        "header over 16 KB": request("GET", "/v1/models", headers=[*auth, ("X-Big", "a" * 17000)]),
        "NUL in a header": request("GET", "/v1/models", headers=[*auth, ("X-A", "a\x00b")]),
        "bad Content-Length": request("POST", "/v1/chat/completions", body=b"{}",
                                      headers=[*auth, ("Content-Length", "abc")]),
    }.items():
        r = _raw(stack, data)
        assert r.status == 400, (name, r.status, r.raw[:200])
        assert key not in r.raw.decode("latin-1")


def test_silent_connections_and_http2_prefaces_are_bounded(stack) -> None:
    with ThreadPoolExecutor(3) as pool:
        silent = pool.submit(_raw, stack, b"", 40.0)
        half = pool.submit(_raw, stack, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n", 40.0)
        h2 = pool.submit(_raw, stack, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 40.0)
        bound = HTTP_REQUEST_TIMEOUT_S + 5
        for name, fut in (("silent", silent), ("half a request", half)):
            r = fut.result()
            assert r.elapsed_s < bound and not r.timed_out, (name, r.elapsed_s)
            # HAProxy's H1 mux answers this 408 with its built-in page, not the errorfile (README).
            assert r.status == 408 and r.headers.get("connection") == "close", (name, r.raw[:200])
        r = h2.result()
        assert r.elapsed_s < bound and not r.timed_out, ("h2 preface", r.elapsed_s, r.raw[:100])
