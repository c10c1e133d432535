"""What an answer tells an agent about its limits, refusals included (issue 40): the limit headers
read from the limiter's own counters, a wait that follows the cause of a refusal, and a code per
cause. The admission is the real one over in-memory counters, on a clock the test holds still."""

from __future__ import annotations

import asyncio
import math
from datetime import UTC, datetime
from typing import Any

import pytest

from serve_app import errors
from serve_app.config import AppConfig, KeyRecord
from serve_app.gateway.accounting.timing import StageClock
from serve_app.gateway.accounting.tracecontext import TraceContext
from serve_app.gateway.accounting.usage import Usage
from serve_app.gateway.admission import admission as admission_module
from serve_app.gateway.admission.admission import Admission
from serve_app.gateway.admission.budgets import Budgets
from serve_app.gateway.admission.ledger import Pass
from serve_app.protocol import ENDPOINTS, Endpoint
from serve_app.state.budgets import MemoryBudgets
from serve_app.state.limits import WINDOW_S, MemoryBackend
from serve_app.state.usage import MemoryUsageStore

NOW = 1_796_000_000.0  # 2026-11-30 00:53:20 UTC
DIGEST = "sha256:" + "0" * 64
BODY = {"model": "tiny", "messages": [], "max_tokens": 10}
SIZE = 40  # body bytes: a 10-token prompt estimate, so each request reserves 20 tokens
RESERVE = 20


def _cfg(**key_limits: int) -> AppConfig:
    return AppConfig.model_validate({
        "tiers": {"premium": {"priority": 0, "key_limits": key_limits}},
        "default_tier": "premium",
        "models": [{"id": "tiny", "source": "builtin:tiny-chat",
                    "deployment": {"max_ongoing_requests": 1, "max_queued_requests": 1}}],
    })


class Env:
    """An admission over in-memory limits and budgets, all on the clock ``NOW``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, budget: int | None = None,
                 **key_limits: int) -> None:
        monkeypatch.setattr(admission_module, "clock", lambda: NOW)
        self.limits = MemoryBackend()
        self.key = KeyRecord(id="k", digest=DIGEST, tier="premium",
                             budget={"tokens": budget, "period": "day"} if budget else None)
        self.admission = Admission(_cfg(**key_limits), self.limits,
                                   usage=Usage(MemoryUsageStore(), None),
                                   budgets=Budgets(MemoryBudgets(), {}, lambda: NOW))

    async def enter(self, endpoint: Endpoint = ENDPOINTS["chat"], **body: Any) -> Pass:
        return await self.admission.enter(self.key, ["tiny"], endpoint, {**BODY, **body}, SIZE,
                                          StageClock(NOW), TraceContext.from_headers({}))

    async def refused(self, endpoint: Endpoint = ENDPOINTS["chat"], **body: Any) -> errors.Refused:
        with pytest.raises(errors.Refused) as err:
            await self.enter(endpoint, **body)
        return err.value

    def backlog(self, kind: str) -> float:
        """Seconds of the key's ``rpm`` or ``tpm`` bucket still to refill, from the counter."""
        return max(0.0, self.limits._tat.get(f"key:{self.key.id}:{kind}", 0.0) - NOW)

    def left(self, kind: str, limit: int) -> int:
        """Units the key's ``rpm`` or ``tpm`` bucket has left, from the counter."""
        return math.floor((WINDOW_S - self.backlog(kind)) / (WINDOW_S / limit))


def run(fn: Any) -> Any:
    return asyncio.run(asyncio.wait_for(fn(), 10))


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(math.ceil(t), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_a_spent_budget_says_stop_until_its_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDKs retry a 429 unless told not to; a budget comes back only at its reset."""
    env = Env(monkeypatch, budget=1000, rpm=10, tpm=100_000)

    async def go() -> errors.Refused:
        await env.enter(max_tokens=990)  # reserves the whole budget: 990 + the 10-token prompt
        return await env.refused()

    exc = run(go)
    assert isinstance(exc, errors.QuotaExceeded) and exc.code == "insufficient_quota"
    assert exc.headers["x-should-retry"] == "false"
    midnight = datetime(2026, 12, 1, tzinfo=UTC).timestamp()
    assert exc.headers["Retry-After"] == str(math.ceil(midnight - NOW))
    assert exc.headers["x-budget-reset"] == "2026-12-01T00:00:00+00:00"
    # The refusal tells the limits as the counters hold them: the two requests counted, the
    # refused one's token reservation given back.
    assert exc.headers["x-ratelimit-remaining-requests"] == str(env.left("rpm", 10)) == "8"
    assert exc.headers["x-ratelimit-remaining-tokens"] == str(env.left("tpm", 100_000))
    assert exc.headers["x-ratelimit-limit-tokens"] == "100000"


def test_a_window_refusal_waits_for_room_and_reports_every_window(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The requests window refuses before the tokens one is read; the answer reports both."""
    env = Env(monkeypatch, rpm=1, tpm=1000)

    async def go() -> errors.Refused:
        await env.enter()
        return await env.refused()

    exc = run(go)
    assert type(exc) is errors.RateLimited and exc.code == "rate_limit_exceeded"
    # One request a minute: the next fits when the first has refilled, 60 s on.
    assert exc.headers["Retry-After"] == "60" and exc.headers["retry-after-ms"] == "60000"
    assert env.backlog("rpm") == 60.0
    assert exc.headers["x-ratelimit-remaining-requests"] == "0"
    assert exc.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert exc.headers["x-ratelimit-remaining-tokens"] == str(env.left("tpm", 1000))
    assert exc.headers["x-ratelimit-reset-tokens"] == f"{env.backlog('tpm'):.3g}s" == "1.2s"


def test_a_concurrency_refusal_has_its_own_code(monkeypatch: pytest.MonkeyPatch) -> None:
    env = Env(monkeypatch, max_concurrent=1, rpm=100)

    async def go() -> errors.Refused:
        await env.enter()
        return await env.refused()

    exc = run(go)
    assert isinstance(exc, errors.ConcurrencyLimited) and exc.status == 429
    assert exc.code == "concurrency_limit_exceeded" and exc.headers["Retry-After"] == "1"
    # The concurrency cap refused it before its request was counted.
    assert exc.headers["x-ratelimit-remaining-requests"] == str(env.left("rpm", 100)) == "99"


def test_an_overload_refusal_tells_the_limits_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused at the model's capacity, before any limit was charged."""
    env = Env(monkeypatch, rpm=100)

    async def go() -> errors.Refused:
        await env.enter()
        await env.enter()  # the model's two slots taken
        return await env.refused()

    exc = run(go)
    assert type(exc) is errors.Overloaded and exc.status == 503
    assert exc.code == "model_at_capacity"
    assert exc.headers["x-ratelimit-remaining-requests"] == str(env.left("rpm", 100)) == "98"


def test_anthropic_limit_headers_only_on_the_messages_routes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    env = Env(monkeypatch, rpm=2, tpm=1000)

    async def go() -> tuple[dict[str, str], dict[str, str], errors.Refused]:
        chat = (await env.enter()).headers
        messages = (await env.enter(ENDPOINTS["messages"])).headers
        refused = await env.refused(ENDPOINTS["count_tokens"])
        return chat, messages, refused

    chat, messages, refused = run(go)
    assert "x-ratelimit-limit-requests" in chat
    assert not [h for h in chat if h.startswith("anthropic-")]
    # The same windows, the reset as the time the window is full again (the counter's TAT).
    assert messages["x-ratelimit-remaining-requests"] == "0"
    assert messages["anthropic-ratelimit-requests-limit"] == "2"
    assert messages["anthropic-ratelimit-requests-remaining"] == "0"
    assert messages["anthropic-ratelimit-requests-reset"] == _rfc3339(NOW + env.backlog("rpm"))
    assert messages["anthropic-ratelimit-requests-reset"] == "2026-11-30T00:54:20Z"
    assert messages["anthropic-ratelimit-tokens-limit"] == "1000"
    assert messages["anthropic-ratelimit-tokens-remaining"] == str(env.left("tpm", 1000))
    assert messages["anthropic-ratelimit-tokens-reset"] == _rfc3339(NOW + env.backlog("tpm"))
    assert refused.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert refused.headers["anthropic-ratelimit-tokens-remaining"] == str(env.left("tpm", 1000))


def test_an_overload_wait_is_short_and_jittered() -> None:
    """Clients refused in one burst must not all return in the same instant."""
    waits = [errors.Overloaded("full", retry_after_s=2).headers for _ in range(50)]
    assert all(2 <= int(h["Retry-After"]) <= 4 for h in waits)
    assert all(2000 <= int(h["retry-after-ms"]) <= 4000 for h in waits)
    assert all(int(h["Retry-After"]) * 1000 >= int(h["retry-after-ms"]) for h in waits)
    assert len({h["retry-after-ms"] for h in waits}) > 1


def test_each_cause_has_its_own_code() -> None:
    causes = [errors.RateLimited("w"), errors.ConcurrencyLimited("c"), errors.QuotaExceeded("q"),
              errors.ServiceUnavailable("u"), errors.Overloaded("o"), errors.Shed("s"),
              errors.QueueTimeout("t"), errors.ShuttingDown("d")]
    assert len({c.code for c in causes}) == len(causes)
    assert all(c.headers["Retry-After"] for c in causes if c.status == 503)
