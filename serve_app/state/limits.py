"""Rate limits (RPM, TPM) and concurrency caps, per key and per tier, with two backends.

Rates use GCRA, a token bucket kept as one number per counter (the theoretical arrival time, TAT):
a limit of L per minute refills one unit every 60/L s and allows a burst of L. A request is
admitted only if *every* counter it touches has room, and then all of them are charged at once,
so concurrent requests cannot overshoot. Tokens are reserved up front (max_tokens plus a prompt
estimate) and settled against the real usage when the request ends, which refunds the difference
(``gateway/admission/charge.py`` decides which counters a request charges).

``MemoryBackend`` serves one gateway replica; ``RedisBackend`` runs the same algorithm in one Lua
script so that several replicas share the limits. ``open_limits`` picks one by
``gateway.state.limits_store``: with one gateway replica the counters stay in memory, because the Redis
round trip sits before every request's first token (issue 22 measured the admission stage at a
75 ms mean and a 420 ms p95 on a busy 2-core host, almost all of it that call). A restarted replica
starts its per-minute counters afresh: at most one minute of RPM/TPM is forgiven.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from serve_app.config import GatewayConfig
from serve_app.state.connections import Connections

if TYPE_CHECKING:
    import redis.asyncio

logger = logging.getLogger("ray.serve")

REDIS_PREFIX = "serve-app:limits:"

WINDOW_S = 60.0


@dataclass(frozen=True)
class Charge:
    """``amount`` units against a counter that allows ``limit`` per minute (rate) or at once (gauge)."""

    counter: str
    amount: float
    limit: int
    gauge: bool = False  # a concurrency count instead of a per-minute rate


@dataclass
class Verdict:
    allowed: bool
    # For each charge, in order: units still available after this request, and seconds until full.
    remaining: list[float] = field(default_factory=list)
    reset_s: list[float] = field(default_factory=list)
    failed: int = -1  # index of the first charge without room
    retry_after_s: float = 0.0


class LimitBackend(Protocol):
    """Where the limit counters live: ``admit`` charges every counter or none (the verdict says
    which limit refused and when to retry), ``refund`` gives back what an unfinished request
    did not use, and ``peek`` reads every counter without charging it (a refused request's
    answer reports the limits as they stand; a refused ``admit`` stops at the first full one)."""

    async def admit(self, charges: list[Charge], now: float) -> Verdict: ...
    async def refund(self, charges: list[Charge], now: float) -> None: ...
    async def peek(self, charges: list[Charge], now: float) -> Verdict: ...


def rate_step(tat: float, now: float, c: Charge) -> tuple[float, bool, float, float]:
    """GCRA for one counter: (new_tat, allowed, remaining, reset_s/retry)."""
    interval = WINDOW_S / c.limit
    base = max(tat, now)
    new_tat = base + c.amount * interval
    over = new_tat - now - WINDOW_S
    if over > 1e-9:
        remaining = max(0.0, (WINDOW_S - (base - now)) / interval)
        return tat, False, math.floor(remaining), over
    return new_tat, True, math.floor((WINDOW_S - (new_tat - now)) / interval), new_tat - now


def standing(charges: list[Charge], values: list[float], now: float) -> Verdict:
    """The verdict of charging nothing: for each counter (its stored value in ``values``: a TAT or
    a gauge's count), the units left and the seconds until it is full again."""
    v = Verdict(allowed=True)
    for c, value in zip(charges, values, strict=True):
        if c.gauge:
            v.remaining.append(max(0.0, c.limit - value))
            v.reset_s.append(0.0)
        else:
            backlog = max(0.0, value - now)
            v.remaining.append(max(0, math.floor((WINDOW_S - backlog) / (WINDOW_S / c.limit))))
            v.reset_s.append(backlog)
    return v


class MemoryBackend:
    """In-process counters: exact for one gateway replica."""

    def __init__(self) -> None:
        self._tat: dict[str, float] = {}
        self._gauge: dict[str, float] = {}

    async def admit(self, charges: list[Charge], now: float) -> Verdict:
        v = Verdict(allowed=True)
        updates: list[tuple[str, float, bool]] = []
        for i, c in enumerate(charges):
            if c.gauge:
                cur = self._gauge.get(c.counter, 0.0)
                ok = cur + c.amount <= c.limit
                v.remaining.append(max(0.0, c.limit - cur - (c.amount if ok else 0)))
                v.reset_s.append(0.0)
                if not ok:
                    v.allowed, v.failed, v.retry_after_s = False, i, 1.0
                    return v
                updates.append((c.counter, cur + c.amount, True))
            else:
                new_tat, ok, remaining, t = rate_step(self._tat.get(c.counter, 0.0), now, c)
                v.remaining.append(remaining)
                v.reset_s.append(t if ok else 0.0)
                if not ok:
                    v.allowed, v.failed, v.retry_after_s = False, i, t
                    return v
                updates.append((c.counter, new_tat, False))
        for counter, value, gauge in updates:
            (self._gauge if gauge else self._tat)[counter] = value
        return v

    async def refund(self, charges: list[Charge], now: float) -> None:
        for c in charges:
            if c.gauge:
                self._gauge[c.counter] = max(0.0, self._gauge.get(c.counter, 0.0) - c.amount)
            elif c.counter in self._tat:
                interval = WINDOW_S / c.limit
                self._tat[c.counter] = max(now, self._tat[c.counter] - c.amount * interval)

    async def peek(self, charges: list[Charge], now: float) -> Verdict:
        return standing(charges, [(self._gauge if c.gauge else self._tat).get(c.counter, 0.0)
                                  for c in charges], now)


_ADMIT_LUA = """
-- KEYS: counters. ARGV[1]: now (s). Then per counter: amount, limit, gauge(0/1).
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local out = {1, 0}
local new = {}
for i = 1, #KEYS do
  local amount = tonumber(ARGV[3 * i])
  local limit = tonumber(ARGV[3 * i + 1])
  local gauge = ARGV[3 * i + 2] == '1'
  local cur = tonumber(redis.call('GET', KEYS[i]) or '0')
  if gauge then
    if cur + amount > limit then
      out[1] = 0; out[2] = i
      table.insert(out, tostring(math.max(0, limit - cur))); table.insert(out, '1')
      return out
    end
    new[i] = cur + amount
    table.insert(out, tostring(limit - cur - amount)); table.insert(out, '0')
  else
    local interval = window / limit
    local base = math.max(cur, now)
    local tat = base + amount * interval
    local over = tat - now - window
    if over > 1e-9 then
      out[1] = 0; out[2] = i
      table.insert(out, tostring(math.floor(math.max(0, (window - (base - now)) / interval))))
      table.insert(out, tostring(over))
      return out
    end
    new[i] = tat
    table.insert(out, tostring(math.floor((window - (tat - now)) / interval)))
    table.insert(out, tostring(tat - now))
  end
end
for i = 1, #KEYS do
  redis.call('SET', KEYS[i], tostring(new[i]), 'EX', math.ceil(window * 2 + 600))
end
return out
"""

_REFUND_LUA = """
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
for i = 1, #KEYS do
  local amount = tonumber(ARGV[3 * i])
  local limit = tonumber(ARGV[3 * i + 1])
  local gauge = ARGV[3 * i + 2] == '1'
  local cur = redis.call('GET', KEYS[i])
  if cur then
    cur = tonumber(cur)
    local v
    if gauge then v = math.max(0, cur - amount) else v = math.max(now, cur - amount * window / limit) end
    redis.call('SET', KEYS[i], tostring(v), 'KEEPTTL')
  end
end
return 1
"""


class RedisBackend:
    """The same algorithm in Redis, atomic across gateway replicas (one script per admission)."""

    def __init__(self, client: redis.asyncio.Redis, prefix: str = REDIS_PREFIX) -> None:
        self._prefix = prefix
        self._client = client
        self._admit = client.register_script(_ADMIT_LUA)
        self._refund = client.register_script(_REFUND_LUA)

    def _args(self, charges: list[Charge], now: float) -> tuple[list[str], list[str]]:
        keys = [self._prefix + c.counter for c in charges]
        args = [repr(now), repr(WINDOW_S)]
        for c in charges:
            args += [repr(float(c.amount)), str(c.limit), "1" if c.gauge else "0"]
        return keys, args

    async def admit(self, charges: list[Charge], now: float) -> Verdict:
        if not charges:
            return Verdict(allowed=True)
        keys, args = self._args(charges, now)
        raw = await self._admit(keys=keys, args=args)
        vals = [float(x) for x in raw[2:]]
        v = Verdict(allowed=bool(int(raw[0])), remaining=vals[0::2], reset_s=vals[1::2])
        if not v.allowed:
            v.failed = int(raw[1]) - 1
            v.retry_after_s = v.reset_s[-1]
            v.reset_s[-1] = 0.0
        return v

    async def refund(self, charges: list[Charge], now: float) -> None:
        if charges:
            keys, args = self._args(charges, now)
            await self._refund(keys=keys, args=args)

    async def peek(self, charges: list[Charge], now: float) -> Verdict:
        if not charges:
            return Verdict(allowed=True)
        raw = await self._client.mget([self._prefix + c.counter for c in charges])
        return standing(charges, [float(x) if x is not None else 0.0 for x in raw], now)


def open_limits(gw: GatewayConfig, connections: Connections) -> LimitBackend:
    """The counters ``gateway.state.limits_store`` asks for (``auto``: shared in Redis only when
    several gateway replicas must agree on them)."""
    store = gw.state.limits_store
    shared = store == "redis" or (store == "auto" and gw.num_replicas > 1)
    if shared and gw.state.redis_url:
        return RedisBackend(connections.redis())
    if gw.num_replicas > 1:
        logger.warning("limits are counted per gateway replica (%d replicas, no shared Redis): "
                       "each key may use up to %dx its limits", gw.num_replicas, gw.num_replicas)
    return MemoryBackend()
