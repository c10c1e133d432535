"""``serve-app doctor``: check a running gateway the way a client sees it, and name the fix.

Every check is one HTTP conversation (httpx, nothing else from this project's runtime), so it runs
from any machine with the base URL and a key, exactly as Codex, Claude Code or Cline would connect.
Each failure prints the fix from the README's troubleshooting table; the exit code is 0 only when
every check passes. The ``diagnose_*`` functions hold the decisions (which status means which
mistake) and are unit-tested on their own.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

# The troubleshooting rows (README and docs/CLIENTS.md), so a failure points at the row that
# explains it.
ROW_CONNECT = "connection refused"
ROW_PROXY = "local proxy failed"
ROW_BASE_URL = "404 Unknown path on every request"
ROW_KEY = "401 invalid_api_key"
ROW_CHOICES = "Error reading choices"
ROW_CLIENT_API = "404 on /v1/responses or /v1/messages"
ROW_CACHE = "no prefix-cache hits"

CONNECT_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 60.0


@dataclass
class Result:
    """One check's verdict: a line of output, and the fix when it failed."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    row: str = ""
    skipped: bool = False

    def lines(self) -> list[str]:
        tag = "SKIP" if self.skipped else ("ok" if self.ok else "FAIL")
        out = [f"  {tag:5} {self.name:16} {self.detail}"]
        if not self.ok and self.fix:
            out.append(f"  {'':5} {'':16} fix: {self.fix}")
            if self.row:
                out.append(f"  {'':5} {'':16} (troubleshooting: \"{self.row}\")")
        return out


@dataclass
class Target:
    """Where the gateway is: ``base`` ends with /v1, ``root`` is the same without it."""

    base: str
    root: str
    problems: list[str] = field(default_factory=list)


# ---- pure diagnosis ---------------------------------------------------------------------------
def parse_base_url(url: str) -> Target:
    """Split a user's base URL into the gateway's root and its /v1 base, noting the usual slips:
    a missing /v1, a doubled /v1, a path after /v1, a missing scheme."""
    problems = []
    raw = url.strip()
    if "://" not in raw:
        problems.append(f"the base URL {raw!r} has no scheme (http://)")
        raw = "http://" + raw
    parts = urlsplit(raw)
    path = parts.path.rstrip("/")
    segments = [s for s in path.split("/") if s]
    v1 = segments.count("v1")
    root_segments = segments[: segments.index("v1")] if v1 else segments
    if v1 == 0:
        problems.append(f"the base URL {url!r} does not end with /v1 (OpenAI clients need it)")
    elif v1 > 1:
        problems.append(f"the base URL {url!r} has /v1 twice (a client appends its own paths)")
    elif segments[-1] != "v1":
        problems.append(f"the base URL {url!r} has a path after /v1: end it at /v1")
    root = f"{parts.scheme}://{parts.netloc}" + "".join("/" + s for s in root_segments)
    return Target(base=root + "/v1", root=root, problems=problems)


def diagnose_connect_error(exc: Exception, url: str) -> tuple[str, str]:
    """(what happened, the fix) for a request that got no HTTP answer at all."""
    host = urlsplit(url).netloc
    text = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.ConnectTimeout) or isinstance(exc, httpx.TimeoutException):
        return (f"no answer from {host} within {CONNECT_TIMEOUT_S:.0f} s ({text})",
                "check the host and port, and that no firewall or proxy sits in between")
    if "Name or service not known" in text or "nodename nor servname" in text or (
        "getaddrinfo" in text or "Temporary failure in name resolution" in text
    ):
        return (f"the host in {url} does not resolve ({text})",
                "fix the host name in the base URL (the gateway binds 127.0.0.1 by default)")
    return (f"nothing answers at {host} ({text})",
            f"start the gateway (`make run`) or point the client at the port it prints; "
            f"nothing listens on {host}")


def diagnose_health(status: int, body: Any) -> tuple[bool, str, str]:
    """(ok, detail, fix) for GET /health at the root."""
    if status == 200 and isinstance(body, dict) and body.get("status") == "ok":
        return True, "the gateway answers /health", ""
    return (False, f"something else answers there (GET /health: {status})",
            "this port is not the serve-app gateway (a local proxy or another server?): point "
            "the client at the port `make run` prints")


def error_message(body: Any) -> str:
    """The message of an OpenAI- or Anthropic-shaped error body, else a short dump of it."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    text = body if isinstance(body, str) else json.dumps(body)
    return text[:200]


def diagnose_key(status: int, body: Any) -> tuple[bool, str, str]:
    """(ok, detail, fix) for GET /v1/models with the key."""
    if status == 200 and isinstance(body, dict) and isinstance(body.get("data"), list):
        ids = [m.get("id") for m in body["data"] if isinstance(m, dict)]
        if not ids:
            return (False, "the key is valid but sees no model",
                    "create a key with models: `serve-app keys create --id NAME --models '*'`")
        return True, f"the key is valid and sees {len(ids)} model(s): {', '.join(map(str, ids))}", ""
    if status == 401:
        return (False, f"401: {error_message(body)}",
                "use the key `make run` printed (OPENAI_API_KEY=...), or create one with "
                "`serve-app keys create --id NAME`; send it as 'Authorization: Bearer KEY' or "
                "'x-api-key: KEY'")
    if status == 404:
        return (False, f"404 on /v1/models: {error_message(body)}",
                "the base URL must end with exactly one /v1 (http://HOST:PORT/v1)")
    return False, f"GET /v1/models answered {status}: {error_message(body)}", \
        "see the gateway's log (serve-app run --verbose)"


def diagnose_chat(status: int, body: Any) -> tuple[bool, str]:
    """(ok, detail) for a chat completion: parsable ``choices`` with a message."""
    if status != 200:
        return False, f"{status}: {error_message(body)}"
    try:
        choice = body["choices"][0]
        message = choice["message"]
        assert message["role"] == "assistant"
        tokens = body["usage"]["completion_tokens"]
    except (KeyError, IndexError, TypeError, AssertionError):
        return False, f"200 but no parsable choices: {json.dumps(body)[:200]}"
    return True, f"chat answered ({tokens} tokens, finish_reason {choice.get('finish_reason')})"


def is_not_a_chat_model(status: int, body: Any) -> bool:
    """The gateway's answer to chat on an embedding model (then the model is tried as one)."""
    return status == 400 and "model and does not serve" in error_message(body)


def diagnose_embeddings(status: int, body: Any) -> tuple[bool, str]:
    if status != 200:
        return False, f"{status}: {error_message(body)}"
    try:
        dims = len(body["data"][0]["embedding"])
    except (KeyError, IndexError, TypeError):
        return False, f"200 but no parsable data[0].embedding: {json.dumps(body)[:200]}"
    return True, f"embeddings answered ({dims} dimensions)"


def diagnose_stream(status: int, lines: list[str]) -> tuple[bool, str]:
    """(ok, detail) for a streamed chat: ``data:`` events that end with ``data: [DONE]``."""
    if status != 200:
        return False, f"{status}: {' '.join(lines)[:200]}"
    events = [ln for ln in lines if ln.startswith("data:")]
    if not events:
        return False, "200 but no SSE events (a proxy buffering or rewriting the stream?)"
    if events[-1].strip() != "data: [DONE]":
        return False, f"the stream ended without data: [DONE] (last event: {events[-1][:120]})"
    return True, f"{len(events) - 1} events, then data: [DONE]"


def diagnose_responses(status: int, body: Any) -> tuple[bool, str]:
    if status != 200:
        return False, f"POST /v1/responses: {status}: {error_message(body)}"
    if not (isinstance(body, dict) and body.get("object") == "response"
            and isinstance(body.get("output"), list)):
        return False, f"POST /v1/responses: 200 but not a response object: {json.dumps(body)[:200]}"
    return True, f"Responses API answered (status {body.get('status')})"


def diagnose_messages(status: int, body: Any) -> tuple[bool, str]:
    if status != 200:
        return False, f"POST /v1/messages: {status}: {error_message(body)}"
    if not (isinstance(body, dict) and body.get("type") == "message"
            and isinstance(body.get("content"), list)):
        return False, f"POST /v1/messages: 200 but not a message: {json.dumps(body)[:200]}"
    return True, f"Messages API answered (stop_reason {body.get('stop_reason')})"


def diagnose_prefix_cache(cold: tuple[float, int], warm: tuple[float, int]) -> tuple[bool, str, str]:
    """(ok, detail, fix) from (TTFT s, cached tokens) of a cold request and of the best of the
    requests that share its prefix."""
    cold_ttft, cold_cached = cold
    warm_ttft, warm_cached = warm
    detail = (f"cached_tokens {cold_cached} -> {warm_cached}, "
              f"TTFT {cold_ttft * 1000:.0f} ms -> {warm_ttft * 1000:.0f} ms")
    if warm_cached <= 0:
        return (False, detail,
                "turn on the model's prefix cache (engine.enable_prefix_caching) and "
                "frontend.enable_prompt_tokens_details, so usage reports cached_tokens")
    if warm_ttft >= cold_ttft:
        return (False, detail,
                "prefix-cache hits but no faster first token: the engine is busy (queued "
                "requests) or the prefix is too short to matter; run it again when idle")
    return True, detail, ""


def proxy_problem(env: dict[str, str], url: str) -> str:
    """Why an HTTP(S)_PROXY variable would send this URL to a proxy (the "local proxy failed"
    row), or "" when the URL goes direct."""
    host = urlsplit(url).hostname or ""
    proxy = next((env[k] for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy",
                                   "ALL_PROXY", "all_proxy") if env.get(k)), "")
    if not proxy:
        return ""
    no_proxy = {h.strip().lower() for k in ("NO_PROXY", "no_proxy")
                for h in env.get(k, "").split(",") if h.strip()}
    if "*" in no_proxy or host.lower() in no_proxy:
        return ""
    return (f"a proxy variable is set ({proxy}) and {host} is not in NO_PROXY: clients that "
            f"honour it send the gateway's traffic to that proxy")


# ---- the checks -------------------------------------------------------------------------------
class Doctor:
    """Runs the checks in order against one gateway with one key; later checks that need an
    earlier one to pass are skipped (and fail the run) when it did not."""

    def __init__(self, base_url: str, api_key: str, client: httpx.Client,
                 env: dict[str, str] | None = None) -> None:
        self.target = parse_base_url(base_url)
        self.user_url = base_url
        self.key = api_key
        self.http = client
        self.env = dict(os.environ) if env is None else env
        self.models: list[str] = []
        self.chat_models: list[str] = []

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    @staticmethod
    def _json(resp: httpx.Response) -> Any:
        try:
            return resp.json()
        except ValueError:
            return resp.text[:200]

    def run(self) -> Iterator[Result]:
        yield self.check_proxy_env()
        server = self.check_server()
        yield server
        base = self.check_base_url(server.ok)
        yield base
        key = self.check_key(server.ok and base.ok)
        yield key
        ready = server.ok and base.ok and key.ok
        yield from self.check_models(ready)
        chat = ready and bool(self.chat_models)
        yield self.guarded("streaming", chat, self.check_stream)
        yield self.guarded("responses api", chat, self.check_responses)
        yield self.guarded("messages api", chat, self.check_messages)
        yield self.guarded("prefix cache", chat, self.check_prefix_cache)

    @staticmethod
    def guarded(name: str, ready: bool, check: Callable[[], Result]) -> Result:
        if not ready:
            return Result(name, False, "not run: needs a reachable gateway, a valid key and a "
                          "chat model", skipped=True)
        try:
            return check()
        except httpx.HTTPError as exc:
            what, fix = diagnose_connect_error(exc, name)
            return Result(name, False, what, fix, ROW_CONNECT)

    def check_proxy_env(self) -> Result:
        problem = proxy_problem(self.env, self.target.root)
        if problem:
            host = urlsplit(self.target.root).hostname
            return Result("proxy variables", False, problem,
                          f"export NO_PROXY={host},localhost,127.0.0.1 (and no_proxy)", ROW_PROXY)
        return Result("proxy variables", True, "no proxy variable redirects the gateway's URL")

    def check_server(self) -> Result:
        url = self.target.root + "/health"
        t0 = time.monotonic()
        try:
            resp = self.http.get(url)
        except httpx.HTTPError as exc:
            what, fix = diagnose_connect_error(exc, url)
            return Result("server", False, what, fix, ROW_CONNECT)
        ok, detail, fix = diagnose_health(resp.status_code, self._json(resp))
        ms = (time.monotonic() - t0) * 1000
        return Result("server", ok, f"{detail} at {self.target.root} ({ms:.0f} ms)", fix,
                      ROW_PROXY)

    def check_base_url(self, server_ok: bool) -> Result:
        fix = f"use --base-url {self.target.base} (OpenAI clients and Codex: with /v1; " \
              f"Claude Code's ANTHROPIC_BASE_URL: {self.target.root}, without /v1)"
        if self.target.problems:
            return Result("base url", False, "; ".join(self.target.problems), fix, ROW_BASE_URL)
        if not server_ok:
            return Result("base url", True, f"{self.user_url} is well formed (not reachable)")
        return Result("base url", True, f"{self.target.base}")

    def check_key(self, ready: bool) -> Result:
        if not ready:
            return Result("api key", False, "not run: the base URL or the server failed",
                          skipped=True)
        url = self.target.base + "/models"
        try:
            resp = self.http.get(url, headers=self._headers())
        except httpx.HTTPError as exc:
            what, fix = diagnose_connect_error(exc, url)
            return Result("api key", False, what, fix, ROW_CONNECT)
        body = self._json(resp)
        ok, detail, fix = diagnose_key(resp.status_code, body)
        if ok:
            cards = body["data"]
            # Aliases list the model they point at as their parent: check each model once.
            self.models = [str(m["id"]) for m in cards if not m.get("parent")] or \
                [str(m["id"]) for m in cards]
            # Claude Code with ANTHROPIC_API_KEY sends the key as x-api-key.
            alt = self.http.get(url, headers={"x-api-key": self.key})
            if alt.status_code != 200:
                return Result("api key", False, f"Bearer works but x-api-key gets {alt.status_code}",
                              "upgrade the gateway (Claude Code's ANTHROPIC_API_KEY sends x-api-key); "
                              "meanwhile use ANTHROPIC_AUTH_TOKEN", ROW_KEY)
            detail += " (Bearer and x-api-key)"
        return Result("api key", ok, detail, fix, ROW_KEY)

    def check_models(self, ready: bool) -> Iterator[Result]:
        if not ready:
            yield Result("models", False, "not run: needs a valid key", skipped=True)
            return
        for model in self.models:
            yield self.check_model(model)

    def check_model(self, model: str) -> Result:
        name = f"model {model}"
        fix = ("the model replica failed or is still starting: `serve-app diagnose` shows its "
               "state; a client that reports 'Error reading choices' got this error body")
        try:
            resp = self.http.post(self.target.base + "/chat/completions", headers=self._headers(),
                                  json={"model": model, "max_tokens": 4,
                                        "messages": [{"role": "user", "content": "Say hi."}]})
            body = self._json(resp)
            if is_not_a_chat_model(resp.status_code, body):
                resp = self.http.post(self.target.base + "/embeddings", headers=self._headers(),
                                      json={"model": model, "input": ["doctor"]})
                ok, detail = diagnose_embeddings(resp.status_code, self._json(resp))
                return Result(name, ok, detail, fix, ROW_CHOICES)
        except httpx.HTTPError as exc:
            what, fix2 = diagnose_connect_error(exc, self.target.base)
            return Result(name, False, what, fix2, ROW_CONNECT)
        ok, detail = diagnose_chat(resp.status_code, body)
        if ok:
            self.chat_models.append(model)
        return Result(name, ok, detail, fix, ROW_CHOICES)

    def check_stream(self) -> Result:
        model = self.chat_models[0]
        payload = {"model": model, "max_tokens": 8, "stream": True,
                   "messages": [{"role": "user", "content": "Count to three."}]}
        with self.http.stream("POST", self.target.base + "/chat/completions",
                              headers=self._headers(), json=payload) as resp:
            lines = [ln for ln in resp.iter_lines() if ln.strip()]
        ok, detail = diagnose_stream(resp.status_code, lines)
        return Result("streaming", ok, f"{model}: {detail}",
                      "a proxy between the client and the gateway buffers or cuts SSE streams: "
                      "connect directly, or turn off its buffering", ROW_CHOICES)

    def check_responses(self) -> Result:
        model = self.chat_models[0]
        resp = self.http.post(self.target.base + "/responses", headers=self._headers(),
                              json={"model": model, "input": "Say hi.", "max_output_tokens": 8,
                                    "store": False})
        ok, detail = diagnose_responses(resp.status_code, self._json(resp))
        return Result("responses api", ok, f"{model}: {detail}",
                      "Codex needs POST /v1/responses (wire_api = \"responses\"): upgrade the "
                      "gateway", ROW_CLIENT_API)

    def check_messages(self) -> Result:
        model = self.chat_models[0]
        resp = self.http.post(self.target.root + "/v1/messages",
                              headers={"x-api-key": self.key, "anthropic-version": "2023-06-01"},
                              json={"model": model, "max_tokens": 8,
                                    "messages": [{"role": "user", "content": "Say hi."}]})
        ok, detail = diagnose_messages(resp.status_code, self._json(resp))
        return Result("messages api", ok, f"{model}: {detail}",
                      "Claude Code needs POST /v1/messages at ANTHROPIC_BASE_URL (no /v1): "
                      "upgrade the gateway", ROW_CLIENT_API)

    def _ttft(self, model: str, messages: list[dict[str, str]]) -> tuple[float, int]:
        """(seconds to the first content event, cached prompt tokens) of one streamed request."""
        payload = {"model": model, "max_tokens": 2, "stream": True, "messages": messages,
                   "stream_options": {"include_usage": True}, "temperature": 0}
        t0 = time.monotonic()
        first = 0.0
        cached = 0
        with self.http.stream("POST", self.target.base + "/chat/completions",
                              headers=self._headers(), json=payload) as resp:
            if resp.status_code != 200:
                resp.read()
                raise RuntimeError(f"{resp.status_code}: {error_message(self._json(resp))}")
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if not first and chunk.get("choices"):
                    first = time.monotonic() - t0
                usage = chunk.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                cached = max(cached, int(details.get("cached_tokens") or 0))
        return first or (time.monotonic() - t0), cached

    def check_prefix_cache(self) -> Result:
        """Requests that differ only at the end: the later ones must hit the cache and start
        sooner. The shared prefix starts with a fresh nonce, so the first one is surely cold."""
        model = self.chat_models[0]
        nonce = uuid.uuid4().hex
        prefix = f"Session {nonce}. " + "Read the notes below and answer briefly. " * 150

        def ask(tail: str) -> tuple[float, int]:
            return self._ttft(model, [{"role": "system", "content": prefix},
                                      {"role": "user", "content": tail}])

        try:
            cold = ask("first question")
            warm = min((ask(f"question {i}") for i in range(3)), key=lambda r: r[0])
        except RuntimeError as exc:
            return Result("prefix cache", False, f"{model}: {exc}", "see the gateway's log")
        ok, detail, fix = diagnose_prefix_cache(cold, warm)
        return Result("prefix cache", ok, f"{model}: {detail}", fix, ROW_CACHE)


def run(base_url: str, api_key: str, *, out: Callable[[str], None] = print,
        client: httpx.Client | None = None) -> int:
    """Run every check, print a line each (and the fix of each failure); 0 if all passed."""
    http = client or httpx.Client(
        timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
        trust_env=False,  # the proxy variables are checked, not followed
    )
    doctor = Doctor(base_url, api_key, http)
    out(f"serve-app doctor: {base_url}")
    failed = skipped = 0
    try:
        for result in doctor.run():
            failed += not result.ok and not result.skipped
            skipped += result.skipped
            for line in result.lines():
                out(line)
    finally:
        if client is None:
            http.close()
    if not failed and not skipped:
        out("all checks passed")
        return 0
    out(f"{failed} check(s) failed, {skipped} not run")
    return 1


def main(base_url: str, api_key: str | None) -> int:
    """``serve-app doctor``: the key defaults to $OPENAI_API_KEY; without one, exit code 2."""
    key = api_key or os.environ.get("OPENAI_API_KEY", "")
    if not key:
        print("error: pass --api-key or set OPENAI_API_KEY", file=sys.stderr)
        return 2
    return run(base_url, key)
