"""Bound how long a request waits for a model that has no healthy replica.

When a model's only replica dies, Ray Serve's router keeps new requests in its queue until a new
replica is ready: 24-35 s on CPU, during which a client saw nothing. ``OutageGuard.first`` waits
for a model's first answer as before, but once a request has waited ``gateway.unavailable_hold_s``
(default 5 s) it asks whether the model is down; if so, the request is withdrawn and answered 503
``service_unavailable`` with ``Retry-After``.

A model counts as down when either
- Ray Serve's public status (``serve.status()``, read by ``replicas.LiveReplicas``) shows none of
  its replicas RUNNING, or
- this gateway saw one of its replicas fail (a stream cut by a dead replica, an answer "engine
  dead") and no answer from the model since: the controller notices a dead replica only at its
  next health check, the gateway at once.

Requests that are merely slow (queued behind others in a healthy model) are never cut here: the
status is read only for requests already older than the hold, at most once per ``status_ttl_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

logger = logging.getLogger("ray.serve")

T = TypeVar("T")

StatusFn = Callable[[], Mapping[str, int | None]]


class ModelDown(Exception):
    """The model had no healthy replica for the whole hold."""


class OutageGuard:
    """Holds requests to a model with no healthy replica for at most ``hold_s``."""

    def __init__(
        self,
        hold_s: float,
        status: StatusFn | None,
        *,
        status_ttl_s: float = 0.5,
        check_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hold_s = hold_s
        self._status = status
        self.status_ttl_s = status_ttl_s
        self.check_s = check_s
        self.clock = clock
        self._failed: dict[str, float] = {}  # model id -> when a replica of it was seen failing
        self._cache: tuple[float, Mapping[str, int | None]] | None = None
        self._fetch: asyncio.Task[Mapping[str, int | None]] | None = None

    # ---- evidence ---------------------------------------------------------------------------
    def saw_failure(self, model_id: str) -> None:
        self._failed.setdefault(model_id, self.clock())

    def saw_answer(self, model_id: str) -> None:
        self._failed.pop(model_id, None)

    async def _running(self) -> Mapping[str, int | None]:
        now = self.clock()
        if self._cache is not None and now - self._cache[0] < self.status_ttl_s:
            return self._cache[1]
        if self._status is None:
            return {}
        if self._fetch is None or self._fetch.done():
            self._fetch = asyncio.get_running_loop().create_task(asyncio.to_thread(self._status))
        try:
            counts = await asyncio.shield(self._fetch)
        except Exception as exc:  # the controller is busy or restarting: no evidence either way
            logger.warning("could not read Ray Serve's status: %s", exc.__class__.__name__)
            counts = {}
        self._cache = (self.clock(), counts)
        return counts

    async def is_down(self, model_id: str) -> bool:
        if model_id in self._failed:
            return True
        return (await self._running()).get(model_id) == 0

    # ---- the hold ---------------------------------------------------------------------------
    async def first(self, model_id: str, answer: Awaitable[T], started: float | None = None) -> T:
        """``answer``'s result; raises ``ModelDown`` (after cancelling it) if the request has
        waited ``hold_s`` since ``started`` and the model is down."""
        started = self.clock() if started is None else started
        task: asyncio.Future[T] = asyncio.ensure_future(answer)
        try:
            wait = max(0.0, started + self.hold_s - self.clock())
            while True:
                done, _ = await asyncio.wait({task}, timeout=wait)
                if done:
                    result = task.result()
                    self.saw_answer(model_id)
                    return result
                if await self.is_down(model_id):
                    task.cancel()
                    raise ModelDown(model_id)
                wait = self.check_s
        except BaseException:
            if not task.done():
                task.cancel()
            raise


def hold_outcome(elapsed_s: float, hold_s: float, slack_s: float = 1.5) -> str:
    """How a request that got 503 during an outage was treated (for tests and the soak):
    ``fast`` (under a second), ``held`` (within the hold plus slack) or ``hung`` (longer)."""
    if elapsed_s < 1.0:
        return "fast"
    return "held" if elapsed_s <= hold_s + slack_s else "hung"
