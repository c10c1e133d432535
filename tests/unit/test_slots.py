"""serve_app.engine.slots: slots handed out in priority order, with a reserve for the top tier."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from serve_app.engine.slots import GatedEngineClient, SlotGate

TOP = 0
BATCH = 10


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_reserve_must_leave_a_slot() -> None:
    with pytest.raises(ValueError, match=r"reserved \(4\) must be >= 0 and < slots \(4\)"):
        SlotGate(slots=4, reserved=4, top_priority=TOP)


def test_lower_tiers_leave_the_reserve_free_and_the_top_tier_takes_it() -> None:
    async def main() -> None:
        gate = SlotGate(slots=4, reserved=1, top_priority=TOP)
        batch = [asyncio.create_task(gate.acquire(BATCH, 1)) for _ in range(5)]
        await _settle()
        assert sum(t.done() for t in batch) == 3 and gate.waiting == 2
        premium = asyncio.create_task(gate.acquire(TOP, 1))
        await _settle()
        assert premium.done() and gate.used == 4
        gate.release(1)  # premium ends: the reserve is free again, batch may not take it
        await _settle()
        assert sum(t.done() for t in batch) == 3
        gate.release(1)  # a batch request ends: the next batch request gets its slot
        await _settle()
        assert sum(t.done() for t in batch) == 4
        for t in batch:
            t.cancel()

    asyncio.run(main())


def test_a_freed_slot_goes_to_the_best_priority_waiting_then_the_oldest() -> None:
    async def main() -> None:
        gate = SlotGate(slots=2, reserved=0, top_priority=TOP)
        await gate.acquire(BATCH, 2)
        order: list[str] = []

        async def take(name: str, priority: int) -> None:
            await gate.acquire(priority, 1)
            order.append(name)

        tasks = [asyncio.create_task(take(n, p))
                 for n, p in (("batch-1", BATCH), ("standard", 5), ("batch-2", BATCH), ("premium", TOP))]
        await _settle()
        assert order == []
        gate.release(2)
        await _settle()
        assert order == ["premium", "standard"]
        gate.release(1)
        gate.release(1)
        await _settle()
        assert order == ["premium", "standard", "batch-1", "batch-2"]
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_a_cancelled_waiter_frees_its_place_and_a_cancelled_holder_its_slot() -> None:
    async def main() -> None:
        gate = SlotGate(slots=1, reserved=0, top_priority=TOP)
        await gate.acquire(BATCH, 1)
        blocked = asyncio.create_task(gate.acquire(TOP, 1))
        behind = asyncio.create_task(gate.acquire(BATCH, 1))
        await _settle()
        blocked.cancel()
        await _settle()
        assert gate.waiting == 1
        gate.release(1)
        await _settle()
        assert behind.done() and gate.used == 1
        # Granted and cancelled in the same step: the slot must come back.
        gate.release(1)
        await gate.acquire(BATCH, 1)
        granted_late = asyncio.create_task(gate.acquire(BATCH, 1))
        await _settle()
        gate.release(1)  # grants granted_late's future ...
        granted_late.cancel()  # ... but its task is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await granted_late
        assert gate.used == 0

    asyncio.run(main())


def test_parallel_samples_take_one_slot_each_but_never_more_than_a_tier_can_get() -> None:
    gate = SlotGate(slots=4, reserved=1, top_priority=TOP)
    assert gate.weight(BATCH, 2) == 2
    assert gate.weight(BATCH, 8) == 3
    assert gate.weight(TOP, 8) == 4


@dataclass
class Params:
    n: int = 1


@dataclass
class FakeEngine:
    tokens: int
    closed: list[str] = field(default_factory=list)

    async def generate(self, prompt: Any, params: Any, request_id: str, **_: Any) -> AsyncIterator[int]:
        try:
            for i in range(self.tokens):
                await asyncio.sleep(0.01)
                yield i
        finally:
            self.closed.append(request_id)


def test_the_client_holds_a_slot_for_the_stream_and_gives_it_back_however_it_ends() -> None:
    async def main() -> None:
        gate = SlotGate(slots=2, reserved=1, top_priority=TOP)
        engine = FakeEngine(tokens=5)
        client = GatedEngineClient(engine, gate)
        seen = [t async for t in client.generate("p", Params(), "a", priority=BATCH)]
        assert seen == [0, 1, 2, 3, 4] and gate.used == 0

        stream = client.generate("p", Params(), "b", priority=BATCH)
        assert await stream.__anext__() == 0
        assert gate.used == 1
        await stream.aclose()  # the client went away
        assert gate.used == 0 and engine.closed == ["a", "b"]

        # A batch request waits for the one batch slot; a premium one goes straight in.
        first = client.generate("p", Params(), "c", priority=BATCH)
        await first.__anext__()
        second = asyncio.create_task(client.generate("p", Params(), "d", priority=BATCH).__anext__())
        premium = [t async for t in client.generate("p", Params(), "e", priority=TOP)]
        assert premium == [0, 1, 2, 3, 4] and not second.done()
        await first.aclose()
        assert await second == 0
        second.cancel()

    asyncio.run(main())
