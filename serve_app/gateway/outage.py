"""Bound how long a request waits for a model that has no healthy replica.

When a model's only replica dies, Ray Serve's router keeps new requests in its queue until a new
replica is ready: 24-35 s on CPU, during which a client saw nothing. ``OutageGuard.first`` waits
for a model's first answer as before, but once a request has waited ``gateway.http.unavailable_hold_s``
(default 5 s) it asks whether the model is down; if so, the request is withdrawn and answered 503
``service_unavailable`` with ``Retry-After``. This is the only place that hold is waited.

A model counts as down when either
- the last reading of Ray Serve's status (``replicas.LiveReplicas``) shows none of its replicas
  RUNNING, or
- this gateway saw one of its replicas fail (a stream cut by a dead replica, an answer "engine
  dead") and no answer from the model since: the controller notices a dead replica only at its
  next health check, the gateway at once.

Requests that are merely slow (queued behind others in a healthy model) are never cut here: the
question is asked only of requests older than the hold, then again every
``gateway.replicas_refresh_s`` (the status cannot change faster).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from serve_app.gateway.routing.replicas import LiveReplicas

T = TypeVar("T")


class ModelDown(Exception):
    """The model had no healthy replica when the hold ended."""


class OutageGuard:
    """Holds requests to a model with no healthy replica for at most ``hold_s``."""

    def __init__(self, hold_s: float, replicas: LiveReplicas | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s
        self._replicas = replicas
        self._clock = clock
        self._failed: set[str] = set()  # models a replica of which was seen failing

    def saw_failure(self, model_id: str) -> None:
        self._failed.add(model_id)

    def is_down(self, model_id: str) -> bool:
        if model_id in self._failed:
            return True
        return self._replicas is not None and self._replicas.running(model_id) == 0

    async def first(self, model_id: str, answer: Awaitable[T], started: float) -> T:
        """``answer``'s result; raises ``ModelDown`` (after cancelling it) if the request has
        waited ``hold_s`` since ``started`` and the model is down."""
        task: asyncio.Future[T] = asyncio.ensure_future(answer)
        wait = max(0.0, started + self.hold_s - self._clock())
        recheck_s = self._replicas.refresh_s if self._replicas is not None else self.hold_s
        try:
            while not (await asyncio.wait({task}, timeout=wait))[0]:
                if self.is_down(model_id):
                    raise ModelDown(model_id)
                wait = recheck_s
        finally:
            if not task.done():
                task.cancel()
        result = task.result()
        self._failed.discard(model_id)  # an answer: the model is up
        return result
