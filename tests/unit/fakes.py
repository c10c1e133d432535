"""Stand-ins for the model side of a ``ModelClient``, shared by the gateway's unit tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, NamedTuple

HANG = object()  # a stream item at which __anext__ never returns


class StepClock:
    """A monotonic clock that moves only when the test steps it, for objects that take a ``clock``:
    a test steps past an interval instead of sleeping it out."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def step(self, seconds: float) -> None:
        self.now += seconds


class FakeStream:
    """Stands in for a ``protocol.ModelCall`` (``__anext__`` and ``cancel``): yields
    its items in order, raises those that are exceptions, and waits forever at ``HANG``."""

    def __init__(self, items: list[Any]) -> None:
        self.items = list(items)
        self.cancelled = False

    async def __anext__(self) -> Any:
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if item is HANG:
            await asyncio.Event().wait()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True
        self.items = []


class Call(NamedTuple):
    """One ``call(endpoint, body, ctx)``, and the model it was made to."""

    model_id: str
    endpoint: str
    body: dict[str, Any]
    ctx: dict[str, Any]


class FakeClient:
    """A model's ``protocol.ModelClient`` as the forwarder calls it: ``call(endpoint, body, ctx)``.

    Each call is recorded in ``calls`` (clients given one list share it, so a test sees the order
    across models) and answered by ``answer``: a stream the test keeps (to see whether it was
    cancelled), or a function that makes a fresh one per call."""

    transport = "fake"

    def __init__(self, answer: FakeStream | Callable[[], FakeStream], model_id: str = "",
                 calls: list[Call] | None = None) -> None:
        self.answer = answer
        self.model_id = model_id
        self.calls: list[Call] = [] if calls is None else calls

    def call(self, endpoint: str, body: dict[str, Any], ctx: dict[str, Any]) -> FakeStream:
        self.calls.append(Call(self.model_id, endpoint, body, ctx))
        return self.answer if isinstance(self.answer, FakeStream) else self.answer()
