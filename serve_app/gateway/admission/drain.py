"""Graceful stop: in-flight streams finish within ``gateway.http.drain_timeout_s``, or end with an error
event and ``[DONE]``; none just stops.

When the app is deleted (Ctrl-C of ``serve-app run``, ``serve shutdown``, ``serve delete``), Ray
Serve waits for a gateway replica's ongoing requests before it stops it, but only up to the
deployment's ``graceful_shutdown_timeout_s``; then it kills the replica, and every stream it still
held was cut with no error event. Ray Serve tells a replica nothing before that, so ``Drain`` reads
``replicas.LiveReplicas``, which sees the app's public status turn ``DELETING``. From the moment
that was seen:

- new requests get 503 ``service_unavailable`` with ``Retry-After``;
- streams keep going until ``timeout_s`` has passed; those still running then are cancelled at the
  model and end with an error event (``stopped`` tells the relay so).

The gateway's ``graceful_shutdown_timeout_s`` is ``gateway.http.drain_timeout_s`` plus a margin
(app.py) that covers the status's refresh period, so Ray Serve never kills a replica before its
drain ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from serve_app.gateway.routing.replicas import LiveReplicas

logger = logging.getLogger("ray.serve")


class Stream:
    """One in-flight stream: ``stop`` cancels it at the model; ``stopped`` says the drain did."""

    def __init__(self, cancel: Callable[[], Any]) -> None:
        self._cancel = cancel
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True
        self._cancel()


class Drain:
    """The gateway replica's in-flight streams, and whether the app is being stopped."""

    def __init__(self, timeout_s: float, replicas: LiveReplicas | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._replicas = replicas
        self.clock = clock
        self.since: float | None = None
        self.active: set[Stream] = set()
        self._task: asyncio.Task[None] | None = None

    @property
    def draining(self) -> bool:
        if self.since is None and self._replicas is not None:
            self.since = self._replicas.deleting_since
            if self.since is not None:
                logger.warning("the app is stopping: %d streams get up to %.0f s to finish",
                               len(self.active), self.timeout_s)
        return self.since is not None

    def track(self, cancel: Callable[[], Any]) -> Stream:
        stream = Stream(cancel)
        self.active.add(stream)
        if self._replicas is not None and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._watch(self._replicas))
        if self.draining and self.clock() - (self.since or 0.0) >= self.timeout_s:
            stream.stop()
        return stream

    def done(self, stream: Stream) -> None:
        self.active.discard(stream)

    async def _watch(self, replicas: LiveReplicas) -> None:
        """While streams run: notice the deletion, then stop what is left at the deadline."""
        while self.active and not self.draining:
            await asyncio.sleep(replicas.refresh_s)
        if self.since is None:
            return
        await asyncio.sleep(max(0.0, self.since + self.timeout_s - self.clock()))
        self.stop_all()

    def stop_all(self) -> int:
        left = list(self.active)
        for s in left:
            s.stop()
        if left:
            logger.warning("drain: ended %d streams with an error event", len(left))
        return len(left)
