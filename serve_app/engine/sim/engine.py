"""The simulated engine's loop: one asyncio task that steps the batch in modelled time.

Each turn schedules a step (``scheduler.Scheduler``), waits the profile's time for it on the
``Clock`` and then completes it, waking the requests that made a token. The clock is the seam for
time: ``ScaledClock`` sleeps ``modelled / time_scale`` of wall-clock time, so 8-32 simulated
replicas fit on two cores; a test passes a clock whose sleep only advances a number.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Protocol

from serve_app.engine.sim.profile import StepProfile
from serve_app.engine.sim.scheduler import Scheduler, SimRequest

logger = logging.getLogger(__name__)


class Clock(Protocol):
    """Modelled time: what the engine reads and waits on."""

    def now(self) -> float:
        """Modelled seconds since an arbitrary start."""
        ...

    async def sleep(self, modelled_s: float) -> None:
        """Return once ``modelled_s`` of modelled time has passed."""

    def idle(self) -> None:
        """The engine waits for work: the time until its next step is no step's."""


class ScaledClock:
    """Modelled time that runs ``time_scale`` times faster than the event loop's clock.

    Steps shorter than ``quantum_s`` of wall-clock time are not slept one by one: their time is
    owed and slept once it adds up to a quantum, so a fast GPU step (5 ms at a time scale of 8 is
    0.6 ms) does not wake the loop a thousand times a second in each of 32 replicas. Tokens then
    come at most one quantum early; the engine's throughput is unchanged.

    While the engine is busy, each step ends its modelled time after the previous step's end, not
    after the moment the loop got round to it: the Python work between steps (completing a step,
    waking its streams, scheduling the next) and a late wake-up of a busy machine are not added to
    the model's time (they were, at 3-4 ms a step on this machine, 15-20 % of a cpu-tiny step).
    Time the engine spent idle is never credited (``idle``), and a lag of more than ``max_lag_s``
    (an overloaded loop) is dropped rather than made up in a burst."""

    def __init__(self, time_scale: float = 1.0, quantum_s: float = 0.002, max_lag_s: float = 0.25) -> None:
        self.time_scale = time_scale
        self.quantum_s = quantum_s
        self.max_lag_s = max_lag_s
        self._t0: float | None = None
        self._due = 0.0  # the loop time that the steps so far have reached
        self._idle = True

    def _loop_time(self) -> float:
        t = asyncio.get_running_loop().time()
        if self._t0 is None:
            self._t0 = t
        return t

    def now(self) -> float:
        t = self._loop_time()
        assert self._t0 is not None
        return (t - self._t0) * self.time_scale

    def idle(self) -> None:
        self._idle = True

    async def sleep(self, modelled_s: float) -> None:
        t = self._loop_time()
        if self._idle or t - self._due > self.max_lag_s:
            self._due = t  # idle time is no credit; a long stall is not made up
            self._idle = False
        self._due += modelled_s / self.time_scale
        ahead = self._due - t
        await asyncio.sleep(ahead if ahead >= self.quantum_s else 0)


@dataclass
class StepReport:
    """What one step did, for the engine's metrics (``stats.SimStats``); times modelled."""

    running: int
    waiting: int
    kv_usage: float
    prompt_tokens: int  # prompt tokens of the requests that made their first token
    generation_tokens: int
    cache_queries: int  # prefix-cache lookups, in tokens
    cache_hits: int
    preemptions: int
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)  # inter-token latencies of the step's tokens
    finished: list[SimRequest] = field(default_factory=list)


class StepSink(Protocol):
    """Where the engine reports each step (the Ray metrics, or a test's list)."""

    def step(self, report: StepReport) -> None: ...


class NoStats:
    """Reports nowhere."""

    def step(self, report: StepReport) -> None:
        return None


class SimEngine:
    """A ``Scheduler`` stepped in modelled time by one task; requests wait on their own event."""

    def __init__(self, scheduler: Scheduler, profile: StepProfile, clock: Clock,
                 sink: StepSink | None = None) -> None:
        self.scheduler = scheduler
        self.profile = profile
        self.clock = clock
        self.sink: StepSink = sink or NoStats()
        self.steps = 0
        self._work = asyncio.Event()
        self._events: dict[SimRequest, asyncio.Event] = {}
        self._task: asyncio.Task[None] | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def submit(self, req: SimRequest) -> None:
        """Queue ``req`` (arrival now) for the next step."""
        req.arrival = self.clock.now()
        self._events[req] = asyncio.Event()
        self.scheduler.add(req)
        self._work.set()

    def abort(self, req: SimRequest) -> None:
        """Take ``req`` out of the engine (idempotent)."""
        self.scheduler.abort(req)
        self._events.pop(req, None)

    async def wait(self, req: SimRequest, have: int) -> None:
        """Return once ``req`` has more than ``have`` tokens or is done."""
        event = self._events.get(req)
        while event is not None and len(req.outputs) <= have and not req.done:
            event.clear()
            await event.wait()

    async def _run(self) -> None:
        try:
            while True:
                if not self.scheduler.running and not self.scheduler.num_waiting:
                    self.clock.idle()
                    self._work.clear()
                    await self._work.wait()
                    continue
                await self._step()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug: health checks fail, the replica is replaced
            logger.exception("simulated engine died")
            self.error = exc
            for event in self._events.values():
                event.set()
            raise

    async def _step(self) -> None:
        sched = self.scheduler
        stats = sched.pool.stats
        before = (stats.queries, stats.hits, sched.preemptions, sched.prompt_tokens,
                  sched.generation_tokens)
        batch = sched.schedule()
        if not batch.scheduled:
            # Nothing fits (a request larger than the pool is refused before it comes here):
            # wait for a change rather than spin.
            self.clock.idle()
            self._work.clear()
            await self._work.wait()
            return
        await self.clock.sleep(self.profile.step_s(batch.work()))
        now = self.clock.now()
        last = {s.request: s.request.last_token_at for s in batch.scheduled}
        made = sched.complete(batch, now)
        self.steps += 1
        report = StepReport(
            running=len(sched.running), waiting=sched.num_waiting, kv_usage=sched.pool.usage,
            cache_queries=stats.queries - before[0], cache_hits=stats.hits - before[1],
            preemptions=sched.preemptions - before[2], prompt_tokens=sched.prompt_tokens - before[3],
            generation_tokens=sched.generation_tokens - before[4])
        for req in made:
            prev = last[req]
            if prev is None:
                report.ttfts.append(now - req.arrival)
            else:
                report.itls.append(now - prev)
            if req.done:
                report.finished.append(req)
            event = self._events.get(req)
            if event is not None:
                event.set()
        self.sink.step(report)
