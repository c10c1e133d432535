"""Graceful stop: in-flight streams finish within ``gateway.drain_timeout_s``, or end with an error
event and ``[DONE]``; none just stops.

When the app is deleted (Ctrl-C of ``serve-app run``, ``serve shutdown``, ``serve delete``), Ray
Serve waits for a gateway replica's ongoing requests before it stops it, but only up to the
deployment's ``graceful_shutdown_timeout_s``; then it kills the replica, and every stream it still
held was cut with no error event. Ray Serve tells a replica nothing before that, so ``Drain`` reads
the app's public status (``serve.status()``: ``DELETING``) once a second while this replica holds
a stream (never when idle). Once the app is deleting:

- new requests get 503 ``service_unavailable`` with ``Retry-After``;
- streams keep going until ``timeout_s`` has passed; those still running then are cancelled at the
  model and end with an error event (``stopped`` tells the relay so).

The gateway's ``graceful_shutdown_timeout_s`` is ``drain_timeout_s`` plus a margin (app.py), so Ray
Serve never kills a replica before its drain ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("ray.serve")

DeletingFn = Callable[[], bool]


def app_deleting_from_status(app_name: str) -> DeletingFn:
    def read() -> bool:
        from ray import serve

        app = serve.status().applications.get(app_name)
        return app is None or str(getattr(app.status, "value", app.status)) == "DELETING"

    return read


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

    def __init__(self, timeout_s: float, deleting: DeletingFn | None, *, poll_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._deleting = deleting
        self.poll_s = poll_s
        self.clock = clock
        self.since: float | None = None
        self.active: set[Stream] = set()
        self._task: asyncio.Task[None] | None = None

    @property
    def draining(self) -> bool:
        return self.since is not None

    def track(self, cancel: Callable[[], Any]) -> Stream:
        stream = Stream(cancel)
        self.active.add(stream)
        if self._deleting is not None and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._watch())
        if self.draining and self.clock() - (self.since or 0.0) >= self.timeout_s:
            stream.stop()
        return stream

    def done(self, stream: Stream) -> None:
        self.active.discard(stream)

    async def _is_deleting(self) -> bool:
        assert self._deleting is not None
        try:
            return await asyncio.to_thread(self._deleting)
        except Exception:  # the controller is gone or busy: no news
            return False

    async def _watch(self) -> None:
        while self.active and not self.draining:
            if await self._is_deleting():
                self.begin()
                break
            await asyncio.sleep(self.poll_s)
        if not self.draining:
            return
        deadline = (self.since or self.clock()) + self.timeout_s
        while self.active and self.clock() < deadline:
            await asyncio.sleep(min(0.1, max(0.0, deadline - self.clock())))
        self.stop_all()

    def begin(self) -> None:
        if self.since is None:
            self.since = self.clock()
            logger.warning("the app is stopping: %d streams get up to %.0f s to finish",
                           len(self.active), self.timeout_s)

    def stop_all(self) -> int:
        left = list(self.active)
        for s in left:
            s.stop()
        if left:
            logger.warning("drain: ended %d streams with an error event", len(left))
        return len(left)
