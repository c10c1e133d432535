"""serve_app.ops.doctor: which answer means which mistake, and the fix printed for it.

The pure ``diagnose_*`` functions are tested directly; the check sequence runs against a small fake
gateway behind httpx.MockTransport (the real gateway is tests/integration/test_doctor.py).
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from serve_app.ops import doctor

KEY = "sk-sa-good"


# ---- base URL ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "base", "root", "problem"),
    [
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1", "http://127.0.0.1:8000", None),
        ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/v1", "http://127.0.0.1:8000", None),
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1", "http://127.0.0.1:8000",
         "does not end with /v1"),
        ("http://127.0.0.1:8000/v1/v1", "http://127.0.0.1:8000/v1", "http://127.0.0.1:8000",
         "/v1 twice"),
        ("http://h:1/v1/chat/completions", "http://h:1/v1", "http://h:1", "a path after /v1"),
        ("127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1", "http://127.0.0.1:8000", "no scheme"),
        ("https://gw.example/llm/v1", "https://gw.example/llm/v1", "https://gw.example/llm", None),
    ],
)
def test_parse_base_url(url: str, base: str, root: str, problem: str | None) -> None:
    t = doctor.parse_base_url(url)
    assert (t.base, t.root) == (base, root)
    if problem is None:
        assert t.problems == []
    else:
        assert any(problem in p for p in t.problems), t.problems


# ---- pure diagnosis ---------------------------------------------------------------------------
def test_connect_refused_says_start_the_gateway() -> None:
    what, fix = doctor.diagnose_connect_error(
        httpx.ConnectError("[Errno 111] Connection refused"), "http://127.0.0.1:9/health")
    assert "nothing answers at 127.0.0.1:9" in what
    assert "make run" in fix


def test_unresolvable_host_says_fix_the_host() -> None:
    what, fix = doctor.diagnose_connect_error(
        httpx.ConnectError("[Errno -2] Name or service not known"), "http://gatewy:8000/health")
    assert "does not resolve" in what and "host name" in fix


def test_timeout() -> None:
    what, _ = doctor.diagnose_connect_error(httpx.ConnectTimeout("timed out"), "http://10.0.0.1/x")
    assert "no answer from 10.0.0.1" in what


def test_health_from_another_server_is_named() -> None:
    assert doctor.diagnose_health(200, {"status": "ok"})[0]
    ok, detail, fix = doctor.diagnose_health(404, "<html>")
    assert not ok and "something else answers" in detail and "proxy" in fix


@pytest.mark.parametrize(
    ("status", "body", "ok", "in_fix"),
    [
        (200, {"object": "list", "data": [{"id": "tiny-chat"}]}, True, ""),
        (200, {"object": "list", "data": []}, False, "keys create"),
        (401, {"error": {"message": "Incorrect API key provided."}}, False, "keys create"),
        (404, {"error": {"message": "Unknown path."}}, False, "one /v1"),
        (500, "oops", False, "log"),
    ],
)
def test_diagnose_key(status: int, body: Any, ok: bool, in_fix: str) -> None:
    got_ok, detail, fix = doctor.diagnose_key(status, body)
    assert got_ok is ok and in_fix in fix
    if status == 401:
        assert "Incorrect API key provided." in detail


def test_diagnose_chat() -> None:
    good = {"choices": [{"message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
            "usage": {"completion_tokens": 4}}
    assert doctor.diagnose_chat(200, good) == (True, "chat answered (4 tokens, finish_reason length)")
    ok, detail = doctor.diagnose_chat(200, {"choices": []})
    assert not ok and "no parsable choices" in detail
    ok, detail = doctor.diagnose_chat(503, {"error": {"message": "model tiny-chat is not ready"}})
    assert not ok and detail == "503: model tiny-chat is not ready"


def test_not_a_chat_model_is_recognised() -> None:
    body = {"error": {"message": "model `minilm-embed` is a embed model and does not serve /v1/chat/completions"}}
    assert doctor.is_not_a_chat_model(400, body)
    assert not doctor.is_not_a_chat_model(400, {"error": {"message": "bad"}})
    assert doctor.diagnose_embeddings(200, {"data": [{"embedding": [0.1] * 384}]})[0]
    assert not doctor.diagnose_embeddings(200, {"data": []})[0]


@pytest.mark.parametrize(
    ("lines", "ok", "text"),
    [
        (["data: {}", "data: {}", "data: [DONE]"], True, "2 events, then data: [DONE]"),
        (["data: {}", "data: {}"], False, "without data: [DONE]"),
        ([], False, "no SSE events"),
    ],
)
def test_diagnose_stream(lines: list[str], ok: bool, text: str) -> None:
    got_ok, detail = doctor.diagnose_stream(200, lines)
    assert got_ok is ok and text in detail


def test_diagnose_responses_and_messages() -> None:
    assert doctor.diagnose_responses(200, {"object": "response", "output": [], "status": "completed"})[0]
    ok, detail = doctor.diagnose_responses(404, {"error": {"message": "Unknown path."}})
    assert not ok and "404: Unknown path." in detail
    assert doctor.diagnose_messages(200, {"type": "message", "content": []})[0]
    ok, detail = doctor.diagnose_messages(401, {"type": "error", "error": {"type": "authentication_error",
                                                                         "message": "bad key"}})
    assert not ok and "401: bad key" in detail


def test_diagnose_prefix_cache() -> None:
    assert doctor.diagnose_prefix_cache((0.050, 0), (0.020, 512))[0]
    ok, detail, fix = doctor.diagnose_prefix_cache((0.050, 0), (0.020, 0))
    assert not ok and "enable_prefix_caching" in fix and "cached_tokens 0 -> 0" in detail
    ok, _, fix = doctor.diagnose_prefix_cache((0.020, 0), (0.030, 512))
    assert not ok and "busy" in fix


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({}, False),
        ({"HTTPS_PROXY": "http://proxy:3128"}, True),
        ({"http_proxy": "http://proxy:3128", "no_proxy": "localhost,127.0.0.1"}, False),
        ({"HTTP_PROXY": "http://proxy:3128", "NO_PROXY": "*"}, False),
    ],
)
def test_proxy_problem(env: dict[str, str], problem: bool) -> None:
    assert bool(doctor.proxy_problem(env, "http://127.0.0.1:8000")) is problem


# ---- the whole run against a fake gateway -----------------------------------------------------
class FakeGateway:
    """Answers like the gateway: /health, /v1/models, chat (stream or not), embeddings,
    /v1/responses, /v1/messages; switches turn single behaviours off."""

    def __init__(self) -> None:
        self.responses = True
        self.cache = True
        self.done = True
        self.x_api_key = True
        self.calls: list[str] = []
        self.prompts_seen: set[str] = set()

    def __call__(self, req: httpx.Request) -> httpx.Response:
        path = req.url.path
        self.calls.append(f"{req.method} {path}")
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        key = req.headers.get("authorization", "").removeprefix("Bearer ")
        if not key and self.x_api_key:
            key = req.headers.get("x-api-key", "")
        if not path.startswith("/v1/"):
            return httpx.Response(404, json={"error": {"message": "Unknown path."}})
        if key != KEY:
            return httpx.Response(401, json={"error": {"message": "Incorrect API key provided."}})
        body = json.loads(req.content) if req.content else {}
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "tiny-chat", "parent": None}, {"id": "tiny", "parent": "tiny-chat"},
                {"id": "minilm-embed", "parent": None}]})
        if path == "/v1/chat/completions":
            if body["model"] == "minilm-embed":
                return httpx.Response(400, json={"error": {
                    "message": "model `minilm-embed` is a embed model and does not serve /v1/chat/completions"}})
            if body.get("stream"):
                prefix = body["messages"][0]["content"]
                cached = 256 if (self.cache and prefix in self.prompts_seen) else 0
                self.prompts_seen.add(prefix)
                if not cached:
                    time.sleep(0.02)  # a cold prefill is slower
                events = [{"choices": [{"delta": {"content": "x"}}]},
                          {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": cached}}}]
                text = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
                if self.done:
                    text += "data: [DONE]\n\n"
                return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
            return httpx.Response(200, json={
                "choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}],
                "usage": {"completion_tokens": 4}})
        if path == "/v1/embeddings":
            return httpx.Response(200, json={"data": [{"embedding": [0.0] * 384}]})
        if path == "/v1/responses" and self.responses:
            return httpx.Response(200, json={"object": "response", "output": [], "status": "completed"})
        if path == "/v1/messages":
            return httpx.Response(200, json={"type": "message", "content": [], "stop_reason": "max_tokens"})
        return httpx.Response(404, json={"error": {"message": "Unknown path."}})


def _run(gw: FakeGateway, url: str = "http://gw:8000/v1", key: str = KEY) -> tuple[int, str]:
    lines: list[str] = []
    client = httpx.Client(transport=httpx.MockTransport(gw))
    code = doctor.run(url, key, out=lines.append, client=client)
    return code, "\n".join(lines)


def _line(out: str, name: str) -> str:
    return next(ln for ln in out.splitlines() if f" {name} " in ln)


def test_all_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    gw = FakeGateway()
    code, out = _run(gw)
    assert code == 0, out
    assert out.endswith("all checks passed")
    assert "FAIL" not in out and "SKIP" not in out
    assert "model tiny-chat" in out and "model minilm-embed" in out and "model tiny " not in out
    assert "embeddings answered (384 dimensions)" in out
    assert "Bearer and x-api-key" in out


def test_wrong_key() -> None:
    code, out = _run(FakeGateway(), key="sk-sa-wrong")
    assert code == 1
    assert "FAIL  api key" in out and "401: Incorrect API key provided." in out
    assert "keys create" in out and "SKIP  models" in out


def test_missing_v1() -> None:
    code, out = _run(FakeGateway(), url="http://gw:8000")
    assert code == 1
    assert "FAIL  base url" in _line(out, "base url")
    assert "use --base-url http://gw:8000/v1" in out
    assert "ok    server" in out  # the gateway itself was found


def test_no_server() -> None:
    def refuse(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=req)

    lines: list[str] = []
    code = doctor.run("http://127.0.0.1:9/v1", KEY, out=lines.append,
                      client=httpx.Client(transport=httpx.MockTransport(refuse)))
    out = "\n".join(lines)
    assert code == 1
    assert "FAIL  server" in out and "nothing answers at 127.0.0.1:9" in out and "make run" in out
    assert out.endswith("1 check(s) failed, 6 not run")


def test_missing_responses_api_names_codex() -> None:
    gw = FakeGateway()
    gw.responses = False
    code, out = _run(gw)
    assert code == 1
    line = _line(out, "responses api")
    assert line.lstrip().startswith("FAIL") and "404: Unknown path." in line
    assert "Codex needs POST /v1/responses" in out


def test_no_cache_hits() -> None:
    gw = FakeGateway()
    gw.cache = False
    code, out = _run(gw)
    assert code == 1 and "FAIL  prefix cache" in out and "enable_prefix_caching" in out


def test_stream_without_done() -> None:
    gw = FakeGateway()
    gw.done = False
    code, out = _run(gw)
    assert code == 1 and "FAIL  streaming" in out and "without data: [DONE]" in out


def test_x_api_key_refused() -> None:
    gw = FakeGateway()
    gw.x_api_key = False
    code, out = _run(gw)
    assert code == 1 and "x-api-key gets 401" in out and "ANTHROPIC_AUTH_TOKEN" in out


def test_proxy_variable_fails_the_run() -> None:
    lines: list[str] = []
    d = doctor.Doctor("http://gw:8000/v1", KEY, httpx.Client(transport=httpx.MockTransport(FakeGateway())),
                      env={"HTTPS_PROXY": "http://corp:3128"})
    results = list(d.run())
    proxy = results[0]
    assert proxy.name == "proxy variables" and not proxy.ok
    assert "NO_PROXY=gw" in proxy.fix
    lines.extend(proxy.lines())
    assert 'troubleshooting: "local proxy failed"' in "\n".join(lines)
