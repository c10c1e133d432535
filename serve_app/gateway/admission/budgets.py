"""Token budgets per key and per tenant: tokens per UTC day or month, enforced across replicas.

A request is admitted while what its key (and its tenant) has committed in the current period,
the settled usage plus the reservations of requests in flight, is under the budget; its
reservation (the same one the TPM limit takes: completion bound plus prompt estimate) is then
added, and settled against the engine's real count when the request ends. So the spend can pass
the budget only by what the requests in flight at that moment use, and a spent budget answers
429 ``insufficient_quota`` until the period ends, with the seconds to that end as ``Retry-After``
(and ``x-should-retry: false``: ``errors.QuotaExceeded``).

The counters live in a ``state.budgets.BudgetBackend``: Redis when replicas share one
(``gateway.state.redis_url``), else SQLite in ``gateway.state.dir`` (durable, and shared by the replicas
of one host), else memory; ``state.open_state`` picks it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from serve_app import errors
from serve_app.config import Budget, KeyRecord
from serve_app.state.budgets import BudgetBackend, Counter

logger = logging.getLogger("ray.serve")


def period(budget: Budget, now: float) -> tuple[str, str]:
    """The current period's stamp and when it ends (ISO, UTC)."""
    t = datetime.fromtimestamp(now, UTC)
    if budget.period == "day":
        start = t.replace(hour=0, minute=0, second=0, microsecond=0)
        end = datetime.fromordinal(start.toordinal() + 1).replace(tzinfo=UTC)
        return start.strftime("%Y-%m-%d"), end.isoformat()
    year, month = (t.year + 1, 1) if t.month == 12 else (t.year, t.month + 1)
    return t.strftime("%Y-%m"), datetime(year, month, 1, tzinfo=UTC).isoformat()


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
            # A tenant's budget binds the keys that name it, never a key whose id is that name.
            ("tenant", key.tenant_id, self.tenant_budgets.get(key.tenant) if key.tenant else None),
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
            wait = datetime.fromisoformat(c.resets_at).timestamp() - self.clock()
            raise errors.QuotaExceeded(
                f"You exceeded the token budget of {what} ({c.limit} tokens per "
                f"{c.name.split(':')[2]}); it resets at {c.resets_at}.",
                headers={**_headers(counters, values), "Retry-After": str(max(1, math.ceil(wait)))},
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
