"""serve_app.gateway.admission.budgets over serve_app.state.budgets' counters: reserve at admission,
settle at the end, across replicas."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from serve_app import errors
from serve_app.config import Budget, KeyRecord
from serve_app.gateway.admission.budgets import Budgets, period
from serve_app.state.budgets import BudgetBackend, MemoryBudgets, RedisBudgets, SqliteBudgets
from serve_app.state.connections import Connections

NOW = 1_796_000_000.0  # 2026-11-30 00:53 UTC
KEY = KeyRecord(id="k1", digest="sha256:" + "0" * 64, tenant="acme",
                budget=Budget(tokens=10_000, period="day"))


def _backend(kind: str, conns: Connections) -> BudgetBackend:
    if kind == "memory":
        return MemoryBudgets()
    if kind == "sqlite":
        return SqliteBudgets(conns.sqlite("usage.sqlite"))
    return RedisBudgets(conns.redis(), prefix=f"test:{uuid.uuid4().hex}:")


@pytest.mark.parametrize("kind", ["memory", "sqlite", "redis"])
def test_budget_is_spent_then_insufficient_quota(kind: str, tmp_path: Path,
                                                 request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        conns = Connections(request.getfixturevalue("redis_url") if kind == "redis" else None,
                            tmp_path)
        budgets = Budgets(_backend(kind, conns), {}, lambda: NOW)
        holds = []
        for _ in range(4):  # 4 x 3000 reserved: the 4th is admitted at 9000 < 10,000
            hold = await budgets.reserve(KEY, 3000)
            assert hold is not None
            holds.append(hold)
        assert holds[-1].headers["x-budget-remaining-tokens"] == "0"
        with pytest.raises(errors.QuotaExceeded) as exc:
            await budgets.reserve(KEY, 1)
        assert exc.value.status == 429 and exc.value.code == "insufficient_quota"
        assert exc.value.headers["x-budget-remaining-tokens"] == "0"
        for h in holds:  # each used 1000 of its 3000: 4000 spent
            await h.settle(1000)
            await h.settle(1000)  # only the first settlement counts
        status = await budgets.status(KEY)
        assert status["key"]["used"] == 4000 and status["key"]["remaining"] == 6000
        assert await budgets.reserve(KEY, 100) is not None
        await conns.close()

    asyncio.run(main())


def test_overshoot_is_bounded_by_the_requests_in_flight(tmp_path: Path) -> None:
    """Concurrent admissions through two connections to one SQLite file (two replicas): the spend
    passes the budget by at most what was reserved by requests admitted below it."""

    async def main() -> int:
        replicas = [Connections(None, tmp_path), Connections(None, tmp_path)]
        a, b = (Budgets(SqliteBudgets(c.sqlite("u.sqlite")), {}, lambda: NOW) for c in replicas)
        admitted = 0

        async def one(budgets: Budgets) -> None:
            nonlocal admitted
            try:
                hold = await budgets.reserve(KEY, 700)
            except errors.QuotaExceeded:
                return
            admitted += 1
            await asyncio.sleep(0)
            assert hold is not None
            await hold.settle(500)

        await asyncio.gather(*(one(a if i % 2 else b) for i in range(60)))
        for c in replicas:
            await c.close()
        return admitted

    admitted = asyncio.run(main())
    # Every admission saw less than 10,000 committed; each commits at most 700.
    assert 10_000 / 700 <= admitted <= 10_000 / 500 + 1


def test_tenant_budget_is_shared_by_its_keys() -> None:
    async def main() -> None:
        budgets = Budgets(MemoryBudgets(), {"acme": Budget(tokens=100, period="month")}, lambda: NOW)
        other = KeyRecord(id="k2", digest="sha256:" + "1" * 64, tenant="acme")
        assert await budgets.reserve(other, 100) is not None
        with pytest.raises(errors.QuotaExceeded, match="tenant 'acme'"):
            await budgets.reserve(KEY, 1)
        assert await budgets.reserve(KeyRecord(id="solo", digest="sha256:" + "2" * 64), 5) is None

    asyncio.run(main())


def test_periods_reset_at_utc_midnight_and_month_start() -> None:
    assert period(Budget(tokens=1, period="day"), NOW) == ("2026-11-30", "2026-12-01T00:00:00+00:00")
    assert period(Budget(tokens=1, period="month"), NOW) == ("2026-11", "2026-12-01T00:00:00+00:00")
    assert period(Budget(tokens=1, period="month"), 1_798_700_000.0)[1] == "2027-01-01T00:00:00+00:00"
