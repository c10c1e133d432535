"""Stand-ins for the model side of a deployment handle, shared by the gateway's unit tests."""

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
    """Stands in for Ray Serve's DeploymentResponseGenerator (``__anext__`` and ``cancel``): yields
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
    """One ``handle.remote(endpoint, body, ctx)`` call, and the model it was made to."""

    model_id: str
    endpoint: str
    body: dict[str, Any]
    ctx: dict[str, Any]


class FakeHandle:
    """A model deployment's handle as the gateway calls it:
    ``handle.options(stream=True).handle.remote(endpoint, body, ctx)``.

    Each call is recorded in ``calls`` (handles given one list share it, so a test sees the order
    across models) and answered by ``answer``: a stream the test keeps (to see whether it was
    cancelled), or a function that makes a fresh one per call."""

    def __init__(self, answer: FakeStream | Callable[[], FakeStream], model_id: str = "",
                 calls: list[Call] | None = None) -> None:
        self.answer = answer
        self.model_id = model_id
        self.calls: list[Call] = [] if calls is None else calls
        self.options_calls: list[dict[str, Any]] = []

    def options(self, **kw: Any) -> _Streaming:
        self.options_calls.append(kw)
        if kw.get("stream") is not True:
            raise AssertionError("the gateway must call model methods as streams")
        return _Streaming(self)


class _Streaming:
    def __init__(self, handle: FakeHandle) -> None:
        self._handle = handle

    def __getattr__(self, method: str) -> _Remote:
        if method != "handle":
            raise AssertionError(f"the model deployment's one entry point is handle, not {method}")
        return _Remote(self._handle)


class _Remote:
    def __init__(self, handle: FakeHandle) -> None:
        self._handle = handle

    def remote(self, endpoint: str, body: dict[str, Any], ctx: dict[str, Any]) -> FakeStream:
        h = self._handle
        h.calls.append(Call(h.model_id, endpoint, body, ctx))
        return h.answer if isinstance(h.answer, FakeStream) else h.answer()
