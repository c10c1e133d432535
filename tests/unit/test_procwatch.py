"""LoopWatch: a stalled event loop shows as lag, CPU time as counted seconds; no real time needed."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_app.runtime.procwatch import LoopWatch


class _Sink:
    def __init__(self) -> None:
        self.lags: list[float] = []
        self.cpu: list[float] = []

    def loop_lag_seen(self, seconds: float) -> None:
        self.lags.append(seconds)

    def cpu_used(self, seconds: float) -> None:
        self.cpu.append(seconds)


class _Time:
    """A clock whose sleep oversleeps by the next planned stall."""

    def __init__(self) -> None:
        self.t = 0.0
        self.cpu = 0.0
        self.stalls: list[float] = []

    def clock(self) -> float:
        return self.t

    def cpu_clock(self) -> float:
        return self.cpu

    async def sleep(self, s: float) -> None:
        self.t += s + (self.stalls.pop(0) if self.stalls else 0.0)
        self.cpu += 0.01


def _watch(t: _Time, sink: _Sink) -> LoopWatch:
    return LoopWatch(sink, interval_s=0.25, report_s=1.0, sleep=t.sleep, clock=t.clock,
                     cpu_clock=t.cpu_clock)


def test_the_worst_lag_of_each_window_and_the_cpu_seconds_are_reported() -> None:
    t, sink = _Time(), _Sink()
    w = _watch(t, sink)
    t.stalls = [0.0, 0.3, 0.05]

    async def run() -> list[float]:
        return [await w.tick() for _ in range(3)]  # 0.25, 0.8, 1.1 s: the window ends

    lags = asyncio.run(run())
    assert lags == pytest.approx([0.0, 0.3, 0.05])
    assert sink.lags == pytest.approx([0.3])
    assert sink.cpu == pytest.approx([0.03])

    async def calm() -> None:
        for _ in range(4):  # 1.35 ... 2.1 s: the next window ends
            await w.tick()

    asyncio.run(calm())
    assert sink.lags == pytest.approx([0.3, 0.0])
    assert sink.cpu == pytest.approx([0.03, 0.04])


def test_a_real_blocked_loop_is_seen() -> None:
    sink = _Sink()

    async def main() -> None:
        w = LoopWatch(sink, interval_s=0.01, report_s=0.01)
        w.start()
        w.start()  # idempotent
        await asyncio.sleep(0.02)
        end = time.monotonic() + 0.15
        while time.monotonic() < end:  # CPU-bound work blocks the loop: the watch wakes late
            pass
        await asyncio.sleep(0.03)
        await w.stop()
        assert not w.running

    asyncio.run(main())
    assert max(sink.lags) >= 0.1
    assert sum(sink.cpu) > 0


def test_bad_intervals_are_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        LoopWatch(_Sink(), interval_s=1.0, report_s=0.5)
