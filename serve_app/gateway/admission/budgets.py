"""Token budgets per key and per tenant: tokens per UTC day or month, enforced across replicas.

A request is admitted while what its key (and its tenant) has committed in the current period,
the settled usage plus the reservations of requests in flight, is under the budget; its
reservation (the same one the TPM limit takes: completion bound plus prompt estimate) is then
added, and settled against the engine's real count when the request ends. So the spend can pass
the budget only by what the requests in flight at that moment use, and a spent budget answers
429 ``insufficient_quota`` until the period ends.

The counters live in Redis when replicas share one (``gateway.redis_url``), else in SQLite in
``gateway.state_dir`` (durable, and shared by the replicas of one host), else in memory.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from serve_app import errors
from serve_app.config import Budget, GatewayConfig, KeyRecord

logger = logging.getLogger("ray.serve")
KEEP_S = 40 * 86400  # a counter outlives its period (a month at most) before Redis drops it


@dataclass(frozen=True)
class Counter:
    """One budget's counter for the current period."""

    name: str  # e.g. "key:alice:2026-12" or "tenant:acme:2026-12-04"
    limit: int
    scope: str  # "key" or "tenant"
    resets_at: str


def period(budget: Budget, now: float) -> tuple[str, str]:
    """The current period's stamp and when it ends (ISO, UTC)."""
    t = datetime.fromtimestamp(now, UTC)
    if budget.period == "day":
        start = t.replace(hour=0, minute=0, second=0, microsecond=0)
        end = datetime.fromordinal(start.toordinal() + 1).replace(tzinfo=UTC)
        return start.strftime("%Y-%m-%d"), end.isoformat()
    year, month = (t.year + 1, 1) if t.month == 12 else (t.year, t.month + 1)
    return t.strftime("%Y-%m"), datetime(year, month, 1, tzinfo=UTC).isoformat()


class BudgetBackend(Protocol):
    """Budget counters. ``admit`` adds ``amount`` to every counter if each one's current value is
    under its limit and returns the values before (or the index of the first that is not:
    ``(values, failed)``); ``add`` adds without a check (settlement; negative refunds); ``get``
    reads them."""

    async def admit(self, counters: Sequence[Counter], amount: int) -> tuple[list[int], int]: ...
    async def add(self, names: Sequence[str], amount: int) -> None: ...
    async def get(self, names: Sequence[str]) -> list[int]: ...
    async def close(self) -> None: ...


class MemoryBudgets:
    """One replica's counters in memory (lost with it)."""

    def __init__(self) -> None:
        self._spent: dict[str, int] = {}

    async def admit(self, counters: Sequence[Counter], amount: int) -> tuple[list[int], int]:
        values = [self._spent.get(c.name, 0) for c in counters]
        for i, (c, v) in enumerate(zip(counters, values, strict=True)):
            if v >= c.limit:
                return values, i
        for c in counters:
            self._spent[c.name] = self._spent.get(c.name, 0) + amount
        return values, -1

    async def add(self, names: Sequence[str], amount: int) -> None:
        for n in names:
            self._spent[n] = self._spent.get(n, 0) + amount

    async def get(self, names: Sequence[str]) -> list[int]:
        return [self._spent.get(n, 0) for n in names]

    async def close(self) -> None:
        return None


class SqliteBudgets:
    """Counters in a SQLite file: durable, and atomic across the processes of one host (each
    admission is one ``BEGIN IMMEDIATE`` transaction). Calls run in a thread, off the event loop."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, timeout=10.0, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS budget (name TEXT PRIMARY KEY, spent INTEGER)")
        self._lock = threading.Lock()

    def _tx(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                out = fn()
                self._db.execute("COMMIT")
                return out
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _values(self, names: Sequence[str]) -> list[int]:
        out = []
        for n in names:
            row = self._db.execute("SELECT spent FROM budget WHERE name = ?", (n,)).fetchone()
            out.append(int(row[0]) if row else 0)
        return out

    def _add(self, names: Sequence[str], amount: int) -> None:
        for n in names:
            self._db.execute("INSERT INTO budget VALUES (?, ?) ON CONFLICT(name) DO UPDATE "
                             "SET spent = spent + excluded.spent", (n, amount))

    def _admit(self, counters: Sequence[Counter], amount: int) -> tuple[list[int], int]:
        values = self._values([c.name for c in counters])
        for i, (c, v) in enumerate(zip(counters, values, strict=True)):
            if v >= c.limit:
                return values, i
        self._add([c.name for c in counters], amount)
        return values, -1

    async def admit(self, counters: Sequence[Counter], amount: int) -> tuple[list[int], int]:
        return await asyncio.to_thread(self._tx, lambda: self._admit(counters, amount))

    async def add(self, names: Sequence[str], amount: int) -> None:
        await asyncio.to_thread(self._tx, lambda: self._add(names, amount))

    async def get(self, names: Sequence[str]) -> list[int]:
        return await asyncio.to_thread(self._tx, lambda: self._values(names))

    async def close(self) -> None:
        self._db.close()


_ADMIT_LUA = """
-- KEYS: counters; ARGV[1]: amount, ARGV[2]: ttl, then one limit per counter.
local values = {}
for i = 1, #KEYS do
  local v = tonumber(redis.call('GET', KEYS[i]) or '0')
  values[i] = v
  if v >= tonumber(ARGV[2 + i]) then
    table.insert(values, 1, i)
    return values
  end
end
for i = 1, #KEYS do
  redis.call('INCRBY', KEYS[i], ARGV[1])
  redis.call('EXPIRE', KEYS[i], ARGV[2])
end
table.insert(values, 1, 0)
return values
"""


class RedisBudgets:
    """Counters in Redis, checked and charged in one script: exact across gateway replicas."""

    def __init__(self, url: str, prefix: str = "serve-app:budget:") -> None:
        import redis.asyncio as redis

        self._redis = redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=2.0)
        self._prefix = prefix
        self._admit = self._redis.register_script(_ADMIT_LUA)

    async def admit(self, counters: Sequence[Counter], amount: int) -> tuple[list[int], int]:
        raw = await self._admit(keys=[self._prefix + c.name for c in counters],
                                args=[amount, KEEP_S, *(c.limit for c in counters)])
        failed, values = int(raw[0]) - 1, [int(v) for v in raw[1:]]
        return values + [0] * (len(counters) - len(values)), failed

    async def add(self, names: Sequence[str], amount: int) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for n in names:
            pipe.incrby(self._prefix + n, amount)
        await pipe.execute()

    async def get(self, names: Sequence[str]) -> list[int]:
        if not names:
            return []
        raw = await self._redis.mget([self._prefix + n for n in names])
        return [int(v) if v is not None else 0 for v in raw]

    async def close(self) -> None:
        await self._redis.aclose()


@dataclass
class BudgetHold:
    """What one admitted request reserved on its budgets; settled once when it ends."""

    budgets: Budgets
    names: list[str]
    reserved: int
    headers: dict[str, str]
    settled: bool = False

    async def settle(self, used: int | None) -> None:
        """Correct the reservation to ``used`` (None, unknown: the reservation stays charged)."""
        if self.settled:
            return
        self.settled = True
        if used is not None and used != self.reserved:
            await self.budgets.add(self.names, used - self.reserved)


class Budgets:
    """The key's and its tenant's budgets: reserve at admission, settle at the end, report."""

    def __init__(self, backend: BudgetBackend, tenant_budgets: dict[str, Budget],
                 clock: Callable[[], float]) -> None:
        self.backend = backend
        self.tenant_budgets = tenant_budgets
        self.clock = clock

    def counters(self, key: KeyRecord) -> list[Counter]:
        now = self.clock()
        out = []
        scopes: list[tuple[str, str, Budget | None]] = [
            ("key", key.id, key.budget),
            ("tenant", key.tenant_id, self.tenant_budgets.get(key.tenant_id)),
        ]
        for scope, name, budget in scopes:
            if budget is not None:
                stamp, resets = period(budget, now)
                out.append(Counter(f"{scope}:{name}:{budget.period}:{stamp}", budget.tokens, scope,
                                   resets))
        return out

    async def reserve(self, key: KeyRecord, tokens: int) -> BudgetHold | None:
        """Reserve ``tokens`` on every budget of ``key``, or raise ``QuotaExceeded`` (429
        insufficient_quota); None when the key has no budget."""
        counters = self.counters(key)
        if not counters:
            return None
        try:
            values, failed = await self.backend.admit(counters, tokens)
        except Exception as exc:
            # As with the limits: an unreachable store serves the request rather than fail it.
            logger.error("budgets not enforced, counter store failed: %s", exc.__class__.__name__)
            return None
        if failed >= 0:
            c = counters[failed]
            what = "this key" if c.scope == "key" else f"tenant {key.tenant_id!r}"
            raise errors.QuotaExceeded(
                f"You exceeded the token budget of {what} ({c.limit} tokens per "
                f"{c.name.split(':')[2]}); it resets at {c.resets_at}.",
                headers=_headers(counters, values),
            )
        after = [v + tokens for v in values]
        return BudgetHold(self, [c.name for c in counters], tokens, _headers(counters, after))

    async def add(self, names: Sequence[str], amount: int) -> None:
        await self.backend.add(names, amount)

    async def status(self, key: KeyRecord) -> dict[str, Any]:
        """The key's budgets for ``/v1/usage`` and the admin API: used and remaining tokens."""
        counters = self.counters(key)
        values = await self.backend.get([c.name for c in counters])
        return {
            c.scope: {"tokens": c.limit, "period": c.name.split(":")[2], "used": v,
                      "remaining": max(0, c.limit - v), "resets_at": c.resets_at}
            for c, v in zip(counters, values, strict=True)
        }


def _headers(counters: Sequence[Counter], values: Sequence[int]) -> dict[str, str]:
    """The tightest budget's remaining tokens and its reset, for the answer's headers."""
    left = [(max(0, c.limit - v), c) for c, v in zip(counters, values, strict=True)]
    remaining, c = min(left, key=lambda x: x[0])
    return {"x-budget-remaining-tokens": str(remaining), "x-budget-reset": c.resets_at}


def open_budgets(gw: GatewayConfig, clock: Callable[[], float]) -> Budgets:
    """Redis when replicas share one, else SQLite in the state dir, else memory."""
    backend: BudgetBackend
    if gw.redis_url:
        backend = RedisBudgets(gw.redis_url)
    elif gw.state_dir:
        backend = SqliteBudgets(Path(gw.state_dir) / "usage.sqlite")
    else:
        backend = MemoryBudgets()
    return Budgets(backend, dict(gw.tenant_budgets), clock)
