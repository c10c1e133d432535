"""Keep some of an engine's slots free for the top tier.

vLLM's priority scheduler picks the best waiting request when a slot frees, but it never preempts a
running request to make room: with every slot taken by long batch streams, a premium request waits
for the next one to finish, which can take seconds. ``SlotGate`` holds requests in the replica
instead, hands free slots out in priority order, and keeps ``reserved`` of them for requests of the
top priority, so a premium request usually finds a slot at once. The engine's own queue stays
(nearly) empty, so the order is decided here.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from typing import Any


class SlotGate:
    """At most ``slots`` requests hold a slot; the last ``reserved`` go only to ``top_priority``.

    Priorities follow vLLM: a lower value runs first. Waiters are served strictly in (priority,
    arrival) order, so a large request at the head is not overtaken by smaller ones behind it.
    """

    def __init__(self, slots: int, reserved: int, top_priority: int) -> None:
        if not 0 <= reserved < slots:
            raise ValueError(f"reserved ({reserved}) must be >= 0 and < slots ({slots})")
        self.slots = slots
        self.reserved = reserved
        self.top_priority = top_priority
        self.used = 0
        self._order = itertools.count()
        self._waiters: list[tuple[int, int, int, asyncio.Future[None]]] = []

    @property
    def waiting(self) -> int:
        return sum(1 for *_, f in self._waiters if not f.done())

    def weight(self, priority: int, n: int) -> int:
        """Slots a request of ``n`` sequences takes (capped so that it can always run)."""
        return max(1, min(n, self._limit(priority)))

    def _limit(self, priority: int) -> int:
        return self.slots if priority <= self.top_priority else self.slots - self.reserved

    def _grant(self) -> None:
        while self._waiters:
            priority, _, weight, fut = self._waiters[0]
            if fut.done():  # cancelled while waiting
                heapq.heappop(self._waiters)
                continue
            if self.used + weight > self._limit(priority):
                return
            heapq.heappop(self._waiters)
            self.used += weight
            fut.set_result(None)

    async def acquire(self, priority: int, weight: int) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._order), weight, fut))
        self._grant()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted, then cancelled: give it back
                self.release(weight)
            else:
                fut.cancel()
                self._grant()  # a blocked head may be gone
            raise

    def release(self, weight: int) -> None:
        self.used -= weight
        self._grant()


class GatedEngineClient:
    """An engine client whose ``generate`` holds a ``SlotGate`` slot for the request's lifetime.

    Everything else is the wrapped engine's. The slot is taken before the request reaches the
    engine and given back when its stream ends, however it ends.
    """

    def __init__(self, engine: Any, gate: SlotGate) -> None:
        self._engine = engine
        self.gate = gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
    ) -> AsyncIterator[Any]:
        priority = int(kwargs.get("priority", 0))
        weight = self.gate.weight(priority, int(getattr(sampling_params, "n", 1) or 1))
        await self.gate.acquire(priority, weight)
        try:
            outputs = self._engine.generate(prompt, sampling_params, request_id, *args, **kwargs)
            try:
                async for out in outputs:
                    yield out
            finally:
                await outputs.aclose()
        finally:
            self.gate.release(weight)
