"""GCRA limits: both backends admit exactly the limit, refund reservations, and report headers."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from serve_app.config import GatewayConfig
from serve_app.state.connections import Connections
from serve_app.state.limits import Charge, MemoryBackend, RedisBackend, open_limits


class _Lazy:
    """Creates the backend inside the test's event loop (redis clients bind to their loop)."""

    def __init__(self, make, conns=None):
        self._make = make
        self._b = None
        self.conns = conns

    def __getattr__(self, name):
        if self._b is None:
            self._b = self._make()
        return getattr(self._b, name)


_current: list[_Lazy] = []


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest):
    if request.param == "memory":
        lazy = _Lazy(MemoryBackend)
    else:
        conns = Connections(request.getfixturevalue("redis_url"), None)
        lazy = _Lazy(lambda: RedisBackend(conns.redis(), prefix=f"test:{request.node.name}:"), conns)
    _current[:] = [lazy]
    return lazy


def run(coro):
    async def with_close():
        try:
            return await coro
        finally:
            for lazy in _current:
                if lazy.conns is not None:
                    await lazy.conns.close()
                lazy._b = None

    return asyncio.run(with_close())


def test_rpm_admits_exactly_the_limit_then_refills(backend) -> None:
    now = 1000.0
    rpm = [Charge("k:rpm", 1, 3)]

    async def go():
        got = [(await backend.admit(rpm, now)).allowed for _ in range(4)]
        later = await backend.admit(rpm, now + 20.0)  # one unit refills every 60/3 = 20 s
        return got, later

    got, later = run(go())
    assert got == [True, True, True, False]
    assert later.allowed


def test_rejection_says_how_long_to_wait(backend) -> None:
    async def go():
        for _ in range(2):
            await backend.admit([Charge("w:rpm", 1, 2)], 0.0)
        return await backend.admit([Charge("w:rpm", 1, 2)], 0.0)

    v = run(go())
    assert not v.allowed and v.failed == 0
    assert v.retry_after_s == pytest.approx(30.0, abs=0.01)


def test_all_or_nothing_across_counters(backend) -> None:
    """A request that fails its tier limit must not consume its key limit."""

    async def go():
        tier_full = [Charge("t1:rpm", 1, 100), Charge("t1:tier", 1, 1)]
        first = await backend.admit(tier_full, 0.0)
        second = await backend.admit(tier_full, 0.0)
        key_only = await backend.admit([Charge("t1:rpm", 1, 100)], 0.0)
        return first, second, key_only

    first, second, key_only = run(go())
    assert first.allowed and not second.allowed and second.failed == 1
    # 100 allowed; one used by `first`; `second` charged nothing; so 98 remain after key_only.
    assert key_only.remaining == [98]


def test_token_reservation_is_refunded_on_settle(backend) -> None:
    async def go():
        tpm = Charge("r:tpm", 900, 1000)
        a = await backend.admit([tpm], 0.0)
        blocked = await backend.admit([Charge("r:tpm", 200, 1000)], 0.0)
        await backend.refund([Charge("r:tpm", 800, 1000)], 0.0)  # used 100 of the 900 reserved
        after = await backend.admit([Charge("r:tpm", 200, 1000)], 0.0)
        return a, blocked, after

    a, blocked, after = run(go())
    assert a.allowed and not blocked.allowed and after.allowed
    assert after.remaining == [700]


def test_concurrency_gauge_is_released(backend) -> None:
    async def go():
        g = [Charge("c:conc", 1, 2, gauge=True)]
        r = [(await backend.admit(g, 0.0)).allowed for _ in range(3)]
        await backend.refund(g, 0.0)
        r.append((await backend.admit(g, 0.0)).allowed)
        return r

    assert run(go()) == [True, True, False, True]


def test_concurrent_admissions_never_overshoot(backend) -> None:
    async def go():
        results = await asyncio.gather(
            *[backend.admit([Charge("race:rpm", 1, 10)], 5.0) for _ in range(40)]
        )
        return sum(v.allowed for v in results)

    assert run(go()) == 10


def test_peek_reports_every_counter_as_it_stands_and_charges_nothing(backend) -> None:
    """A refused admission stops at the first full counter; ``peek`` reads them all, so that a
    refused request's answer still tells its limits (those after the full one included)."""
    rpm, tpm = Charge("p:rpm", 1, 2), Charge("p:tpm", 300, 1000)
    gauge = Charge("p:conc", 1, 4, gauge=True)

    async def go():
        for _ in range(2):
            await backend.admit([gauge, rpm, tpm], 0.0)
        refused = await backend.admit([gauge, rpm, tpm], 10.0)
        first = await backend.peek([gauge, rpm, tpm], 10.0)
        again = await backend.peek([gauge, rpm, tpm], 10.0)
        return refused, first, again

    refused, first, again = run(go())
    assert not refused.allowed and len(refused.remaining) == 2  # the tpm counter unread
    assert first == again  # peeking charged nothing
    # 2 slots held; rpm spent; 600 tokens charged at 0 s, of which 10 s refilled 166.
    assert first.remaining == [2, 0, 566]
    # Seconds until full: two requests at 30 s each, less the 10 s gone; 600 tokens at 0.06 s each.
    assert first.reset_s == pytest.approx([0.0, 50.0, 26.0])
    nothing = run(backend.peek([Charge("fresh:rpm", 1, 5)], 10.0))
    assert nothing.remaining == [5] and nothing.reset_s == [0.0]


@pytest.mark.parametrize(("store", "replicas", "redis_url", "kind"), [
    ("auto", 1, "redis://127.0.0.1:1/0", MemoryBackend),  # one replica: exact in memory, no round trip
    ("auto", 2, "redis://127.0.0.1:1/0", RedisBackend),   # several: shared
    ("auto", 2, None, MemoryBackend),                    # several without Redis: per replica (warned)
    ("memory", 3, "redis://127.0.0.1:1/0", MemoryBackend),
    ("redis", 1, "redis://127.0.0.1:1/0", RedisBackend),
])
def test_open_limits_follows_limits_store(store: str, replicas: int, redis_url: str | None,
                                          kind: type) -> None:
    gw = GatewayConfig(num_replicas=replicas, state={"limits_store": store, "redis_url": redis_url})
    assert isinstance(open_limits(gw, Connections(gw.state.redis_url, None)), kind)


def test_redis_limits_store_needs_a_redis_url() -> None:
    with pytest.raises(ValidationError, match="limits_store"):
        GatewayConfig(state={"limits_store": "redis"})
