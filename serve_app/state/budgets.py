"""Token-budget counters: one integer per budget and period, checked and charged atomically.

In Redis when replicas share one (one script per admission: exact across replicas), else in the
``budget`` table of ``<gateway.state.dir>/usage.sqlite`` (the usage totals' file and connection; each
admission one ``BEGIN IMMEDIATE`` transaction, so atomic across the processes of one host), else
in memory. What a budget is and when it resets is ``gateway/admission/budgets.py``'s business.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from serve_app.state.connections import SqliteFile

if TYPE_CHECKING:
    import redis.asyncio

KEEP_S = 40 * 86400  # a counter outlives its period (a month at most) before Redis drops it
REDIS_PREFIX = "serve-app:budget:"


@dataclass(frozen=True)
class Counter:
    """One budget's counter for the current period."""

    name: str  # e.g. "key:alice:2026-12" or "tenant:acme:2026-12-04"
    limit: int
    scope: str  # "key" or "tenant"
    resets_at: str


class BudgetBackend(Protocol):
    """Budget counters. ``admit`` adds ``amount`` to every counter if each one's current value is
    under its limit and returns the values before (or the index of the first that is not:
    ``(values, failed)``); ``add`` adds without a check (settlement; negative refunds); ``get``
    reads them."""

    async def admit(self, counters: Sequence[Counter], amount: int) -> tuple[list[int], int]: ...
    async def add(self, names: Sequence[str], amount: int) -> None: ...
    async def get(self, names: Sequence[str]) -> list[int]: ...


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


class SqliteBudgets:
    """Counters in the ``budget`` table of a SQLite file: durable, and atomic across the processes
    of one host. Calls run in the file's thread, off the event loop."""

    def __init__(self, file: SqliteFile) -> None:
        self._file = file
        self._ready = False  # the table is created on first use, in the file's thread

    def _schema(self, db: sqlite3.Connection) -> None:
        if not self._ready:
            db.execute("CREATE TABLE IF NOT EXISTS budget (name TEXT PRIMARY KEY, spent INTEGER)")
            self._ready = True

    def _values(self, db: sqlite3.Connection, names: Sequence[str]) -> list[int]:
        self._schema(db)
        out = []
        for n in names:
            row = db.execute("SELECT spent FROM budget WHERE name = ?", (n,)).fetchone()
            out.append(int(row[0]) if row else 0)
        return out

    def _add(self, db: sqlite3.Connection, names: Sequence[str], amount: int) -> None:
        self._schema(db)
        for n in names:
            db.execute("INSERT INTO budget VALUES (?, ?) ON CONFLICT(name) DO UPDATE "
                       "SET spent = spent + excluded.spent", (n, amount))

    async def admit(self, counters: Sequence[Counter], amount: int) -> tuple[list[int], int]:
        def admit(db: sqlite3.Connection) -> tuple[list[int], int]:
            values = self._values(db, [c.name for c in counters])
            for i, (c, v) in enumerate(zip(counters, values, strict=True)):
                if v >= c.limit:
                    return values, i
            self._add(db, [c.name for c in counters], amount)
            return values, -1

        return await self._file.write(admit)

    async def add(self, names: Sequence[str], amount: int) -> None:
        await self._file.write(lambda db: self._add(db, names, amount))

    async def get(self, names: Sequence[str]) -> list[int]:
        return await self._file.write(lambda db: self._values(db, names))


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

    def __init__(self, client: redis.asyncio.Redis, prefix: str = REDIS_PREFIX) -> None:
        self._redis = client
        self._prefix = prefix
        self._admit = client.register_script(_ADMIT_LUA)

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
