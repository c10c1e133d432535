"""Engine death: answer 503 at once, then let Ray Serve replace the replica.

vLLM's engine core runs in a process of its own (``VLLM::EngineCore``). When it dies, AsyncLLM
marks itself ``errored`` and every call raises ``EngineDeadError``, which nothing recovers from:
only a new replica helps. Until this module existed, each request got a 500 for the ~10 s until
Ray Serve's next health check, and then hung until a new replica was ready.

``EngineWatchdog`` polls ``errored`` (a cheap attribute read) a few times a second. From the first
moment the engine is seen dead:

- new requests are answered 503 ``service_unavailable`` with ``Retry-After`` (``dead`` is true),
  and the gateway turns that into a fallback or a clean 503;
- ``check_health`` raises a plain ``RuntimeError`` with a one-line message. vLLM's own
  ``check_health`` raises ``EngineDeadError``, whose exception chain holds the engine's state; Ray
  Serve's controller keeps the exception of every failed health check, and its memory grew from
  about 165 MB to about 790 MB in one engine death. A plain error keeps it flat.
- after ``grace_s`` (long enough for in-flight streams to send their error event and ``[DONE]``),
  the replica process exits, so that Ray Serve's routers drop it and its controller starts a new
  replica at once, instead of at the next health-check period.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from serve_app.runtime import logflush

logger = logging.getLogger("ray.serve")

POLL_S = 0.1
GRACE_S = 0.5


def _exit_process() -> None:
    logflush.flush_all()  # os._exit skips atexit and logging's own flush
    os._exit(1)


class EngineWatchdog:
    """Watches one AsyncLLM; ``dead`` turns true at most ``poll_s`` after its engine core died."""

    def __init__(
        self,
        engine: Any,
        model_id: str,
        *,
        poll_s: float = POLL_S,
        grace_s: float = GRACE_S,
        on_dead: Callable[[], None] | None = None,
        exit_process: Callable[[], None] = _exit_process,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.model_id = model_id
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.on_dead = on_dead
        self.exit_process = exit_process
        self.clock = clock
        self.dead_since: float | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def dead(self) -> bool:
        """True once the engine is seen dead (checked now too, not only by the poller)."""
        if self.dead_since is None and self._engine_errored():
            self._mark_dead()
        return self.dead_since is not None

    def _engine_errored(self) -> bool:
        try:
            return bool(self.engine.errored)
        except Exception:  # an engine half torn down counts as dead
            return True

    def _mark_dead(self) -> None:
        if self.dead_since is not None:
            return
        self.dead_since = self.clock()
        logger.error("engine for %s died; answering 503 and restarting this replica", self.model_id)
        logflush.flush_all()
        if self.on_dead is not None:
            self.on_dead()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while not self.dead:
            await asyncio.sleep(self.poll_s)
        # In-flight streams get their error event and [DONE] from their own tasks meanwhile.
        await asyncio.sleep(self.grace_s)
        logger.error("exiting the replica of %s (engine dead %.2f s)", self.model_id,
                     self.clock() - (self.dead_since or 0.0))
        self.exit_process()

    def check_health(self) -> None:
        """Raise a plain, small error if the engine is dead (never vLLM's exception chain)."""
        if self.dead:
            raise RuntimeError(f"engine of {self.model_id} is dead")
