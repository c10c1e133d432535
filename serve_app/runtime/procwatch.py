"""How late a process's event loop runs and how much CPU the process uses, as metrics.

A gateway or model replica serves every request from one asyncio event loop. When that loop is busy
(CPU-bound work, a blocking call, or the process starved of CPU at Ray's worker niceness 15), every
request waits, and no per-request timer inside the loop can see it: the timer starts late too.
``LoopWatch`` measures it from the outside of any request: a task that sleeps ``interval_s`` and
records how much later than asked it woke. It reports the worst lateness of each ``report_s``
window (a scrape every 15 s would miss a one-second stall in a last-value gauge) and the process's
CPU seconds since the last report (``time.process_time``: user and system time of all threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

logger = logging.getLogger("ray.serve")


class ProcessSink(Protocol):
    """Where the measurements go (``serve_app.metrics.ProcessMetrics``)."""

    def loop_lag_seen(self, seconds: float) -> None: ...

    def cpu_used(self, seconds: float) -> None: ...


class LoopWatch:
    """A periodic task on the running event loop: loop lag (worst per window) and CPU seconds.

    ``start()`` needs a running loop (call it from an async method, or from the first request; it
    is idempotent); ``stop()`` cancels the task. ``sleep``, ``clock`` and ``cpu_clock`` are
    injectable so tests need no real time.
    """

    def __init__(
        self,
        sink: ProcessSink,
        *,
        interval_s: float = 0.25,
        report_s: float = 5.0,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.process_time,
    ) -> None:
        if interval_s <= 0 or report_s < interval_s:
            raise ValueError(f"need 0 < interval_s ({interval_s}) <= report_s ({report_s})")
        self.sink = sink
        self.interval_s = interval_s
        self.report_s = report_s
        self._sleep = sleep
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._task: asyncio.Task[None] | None = None
        self._worst = 0.0
        self._window_start = clock()
        self._cpu = cpu_clock()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the task on the running loop (once)."""
        if not self.running:
            self._window_start = self._clock()
            self._cpu = self._cpu_clock()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-watch")

    def cancel(self) -> asyncio.Task[None] | None:
        """Cancel the task without waiting for it (from a synchronous ``__del__``); returns it."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        return task

    async def stop(self) -> None:
        task = self.cancel()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def tick(self) -> float:
        """One sleep; returns how late it woke (seconds, >= 0) and reports when a window ends."""
        t0 = self._clock()
        await self._sleep(self.interval_s)
        now = self._clock()
        lag = max(0.0, now - t0 - self.interval_s)
        self._worst = max(self._worst, lag)
        if now - self._window_start >= self.report_s:
            self.report(now)
        return lag

    def report(self, now: float) -> None:
        """The window's worst lag and the CPU seconds since the last report; a new window."""
        cpu = self._cpu_clock()
        self.sink.loop_lag_seen(self._worst)
        self.sink.cpu_used(max(0.0, cpu - self._cpu))
        self._worst, self._cpu, self._window_start = 0.0, cpu, now

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a metrics hiccup must not end the watch
                logger.warning("loop watch: report failed", exc_info=True)
