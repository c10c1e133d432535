"""``Admission.enter`` owns the whole entry: a request refused or cancelled at any await of it
(the limit charge, the budget reservation, the flow queue's wait) leaves nothing held, and a
``Pass`` exits exactly once. Only the counter stores are in memory; the admission is the real one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import pytest

from serve_app import errors
from serve_app.config import AppConfig, KeyRecord
from serve_app.gateway.accounting.timing import StageClock
from serve_app.gateway.accounting.tracecontext import TraceContext
from serve_app.gateway.accounting.usage import Usage
from serve_app.gateway.admission.admission import Admission
from serve_app.gateway.admission.budgets import Budgets
from serve_app.gateway.admission.ledger import Outcome, Pass
from serve_app.protocol import ENDPOINTS, tokens_of
from serve_app.state.budgets import Counter, MemoryBudgets
from serve_app.state.limits import Charge, MemoryBackend, Verdict
from serve_app.state.usage import MemoryUsageStore

DIGEST = "sha256:" + "0" * 64
CHAT = ENDPOINTS["chat"]
BODY = {"model": "tiny", "messages": [], "max_tokens": 10}
KEY = KeyRecord(id="k", digest=DIGEST, tier="premium", budget={"tokens": 1000, "period": "day"})


class Gate:
    """Holds a store's answer until the test opens it (``entered`` is set once it is held): the
    store has done the work (as Redis has run a command whose reply is on its way) when its caller
    is cancelled."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.open = asyncio.Event()

    async def hold(self) -> None:
        self.entered.set()
        await self.open.wait()


class GatedLimits(MemoryBackend):
    def __init__(self) -> None:
        super().__init__()
        self.gate: Gate | None = None

    async def admit(self, charges: list[Charge], now: float) -> Verdict:
        verdict = await super().admit(charges, now)
        if self.gate is not None:
            await self.gate.hold()
        return verdict


class GatedBudgets(MemoryBudgets):
    def __init__(self) -> None:
        super().__init__()
        self.gate: Gate | None = None

    async def admit(self, counters: Sequence[Counter], amount: int) -> tuple[list[int], int]:
        result = await super().admit(counters, amount)
        if self.gate is not None:
            await self.gate.hold()
        return result


def _cfg(flow: bool = False) -> AppConfig:
    return AppConfig.model_validate({
        "tiers": {"premium": {"priority": 0, "max_queue_wait_s": 0.05,
                              "key_limits": {"max_concurrent": 4, "tpm": 100_000}}},
        "default_tier": "premium",
        "models": [{"id": "tiny", "source": "builtin:tiny-chat",
                    "flow": {"enabled": flow, "max_inflight_per_replica": 1}}],
    })


class Env:
    def __init__(self, flow: bool = False) -> None:
        cfg = _cfg(flow)
        self.limits = GatedLimits()
        self.budget_store = GatedBudgets()
        self.usage_store = MemoryUsageStore()
        self.admission = Admission(cfg, self.limits, usage=Usage(self.usage_store, None),
                                   budgets=Budgets(self.budget_store, {}, time.time))

    async def enter(self, adapter: str | None = None) -> Pass:
        return await self.admission.enter(KEY, ["tiny"], CHAT, dict(BODY), 40,
                                          StageClock(time.time()), TraceContext.from_headers({}),
                                          adapter=adapter)

    def slots(self) -> float:
        """The key's concurrency slots taken now."""
        return self.limits._gauge.get(f"key:{KEY.id}:conc", 0.0)

    async def budget_used(self) -> int:
        names = [c.name for c in self.admission.budgets.counters(KEY)]  # type: ignore[union-attr]
        return (await self.budget_store.get(names))[0]

    async def settled(self) -> None:
        """Let the give-backs of abandoned work run."""
        for _ in range(20):
            await asyncio.sleep(0)

    async def nothing_held(self) -> None:
        await self.settled()
        assert self.admission.inflight["tiny"] == 0
        assert self.slots() == 0
        assert await self.budget_used() == 0
        assert not self.admission.flow.snapshot().get("tiny", {}).get("waiting")


def run(fn: Any) -> Any:
    return asyncio.run(asyncio.wait_for(fn(), 10))


async def _cancel_while_held(env: Env, gate: Gate) -> None:
    task = asyncio.ensure_future(env.enter())
    await gate.entered.wait()
    task.cancel()
    gate.open.set()  # the store's call completes after its caller left
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_pass_holds_a_slot_and_a_reservation_until_it_exits_once() -> None:
    env = Env()

    async def go() -> None:
        entry = await env.enter()
        assert env.admission.inflight["tiny"] == 1 and env.slots() == 1
        assert await env.budget_used() > 0
        assert entry.headers["x-budget-remaining-tokens"]
        await entry.exit(Outcome(200, tokens_of(3, 4)))
        await entry.exit(Outcome(200, tokens_of(300, 400)))  # only the first exit counts
        assert env.admission.inflight["tiny"] == 0 and env.slots() == 0
        assert await env.budget_used() == 7
        assert (await env.usage_store.get(KEY.id))["completion_tokens"] == 4

    run(go)


def test_an_adapters_usage_is_its_own_while_it_runs_on_its_base_model() -> None:
    env = Env()

    async def go() -> None:
        entry = await env.enter(adapter="tiny-pirate")
        assert entry.model_id == "tiny" and env.admission.inflight["tiny"] == 1
        await entry.exit(Outcome(200, tokens_of(3, 4)))
        plain = await env.enter()
        await plain.exit(Outcome(200, tokens_of(5, 6)))
        usage = await env.usage_store.get(KEY.id)
        assert usage["m:tiny-pirate:completion_tokens"] == 4 and usage["m:tiny:completion_tokens"] == 6
        names = [c.name for c in env.admission.budgets.counters(KEY)]  # type: ignore[union-attr]
        await env.budget_store.add(names, 1000)  # a refusal is the adapter's too
        with pytest.raises(errors.QuotaExceeded):
            await env.enter(adapter="tiny-pirate")
        assert (await env.usage_store.get(KEY.id)).get("rejected_budget") == 1

    run(go)


def test_cancelled_during_the_limit_charge_holds_nothing() -> None:
    env = Env()

    async def go() -> None:
        env.limits.gate = gate = Gate()
        await _cancel_while_held(env, gate)
        await env.nothing_held()

    run(go)


def test_cancelled_during_the_budget_reservation_holds_nothing() -> None:
    # Before, the admission ticket taken just before leaked: its slot and its charge stayed.
    env = Env()

    async def go() -> None:
        env.budget_store.gate = gate = Gate()
        await _cancel_while_held(env, gate)
        await env.nothing_held()

    run(go)


def test_cancelled_in_the_flow_queue_holds_nothing() -> None:
    env = Env(flow=True)

    async def go() -> None:
        holder = await env.enter()  # takes the one slot
        task = asyncio.ensure_future(env.enter())
        for _ in range(50):
            await asyncio.sleep(0.001)
            if env.admission.flow.snapshot()["tiny"]["waiting"]:
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await holder.exit(Outcome(200, tokens_of(0, 0)))
        await env.nothing_held()

    run(go)


def test_a_queue_timeout_gives_back_the_budget_reservation_too() -> None:
    env = Env(flow=True)

    async def go() -> None:
        holder = await env.enter()
        with pytest.raises(errors.ServiceUnavailable) as err:
            await env.enter()  # waits past max_queue_wait_s
        assert err.value.retry_after_s is not None and isinstance(err.value, errors.Refused)
        totals = await env.usage_store.get(KEY.id)
        assert totals.get("rejected_queue_timeout") == 1
        await holder.exit(Outcome(200, tokens_of(0, 0)))
        await env.nothing_held()

    run(go)


def test_a_spent_budget_is_refused_once_and_takes_nothing() -> None:
    env = Env()

    async def go() -> None:
        names = [c.name for c in env.admission.budgets.counters(KEY)]  # type: ignore[union-attr]
        await env.budget_store.add(names, 1000)  # the day's budget is spent
        with pytest.raises(errors.QuotaExceeded) as err:
            await env.enter()
        assert isinstance(err.value, errors.Refused) and err.value.status == 429
        assert (await env.usage_store.get(KEY.id)).get("rejected_budget") == 1
        assert env.admission.inflight["tiny"] == 0 and env.slots() == 0
        assert await env.budget_used() == 1000

    run(go)


class Stopping:
    """A drain whose app is being deleted (``Drain.draining``)."""

    draining = True


def test_a_stopping_app_refuses_new_requests_with_retry_after_and_holds_nothing() -> None:
    env = Env()
    env.admission.drain = Stopping()  # type: ignore[assignment]

    async def go() -> None:
        with pytest.raises(errors.ServiceUnavailable) as err:
            await env.enter()
        assert "shutting down" in err.value.message and err.value.headers["Retry-After"]
        assert (await env.usage_store.get(KEY.id)).get("rejected_backpressure") == 1
        await env.nothing_held()

    run(go)
