"""serve_app.engine.pacing: a paced stream against a fake engine that merges like vLLM's collector."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from vllm.sampling_params import RequestOutputKind, SamplingParams

from serve_app.engine.pacing import PacedEngineClient

STREAM = SamplingParams(output_kind=RequestOutputKind.DELTA)
FINAL = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass
class Out:
    tokens: list[int]
    finished: bool


@dataclass
class FakeEngine:
    """Produces one token per step; while nobody reads, new tokens merge into one pending output,
    as vLLM's RequestOutputCollector does for DELTA streams."""

    steps: int
    step_s: float
    errored: bool = False
    closed: list[str] = field(default_factory=list)

    async def generate(self, prompt: Any, params: Any, request_id: str, **_: Any) -> AsyncIterator[Out]:
        pending: list[int] = []
        done = False
        ready = asyncio.Event()

        async def produce() -> None:
            nonlocal done
            for i in range(self.steps):
                await asyncio.sleep(self.step_s)
                pending.append(i)
                done = i == self.steps - 1
                ready.set()

        task = asyncio.create_task(produce())
        try:
            while True:
                await ready.wait()
                ready.clear()
                out = Out(tokens=pending[:], finished=done)
                pending.clear()
                yield out
                if out.finished:
                    return
        finally:
            task.cancel()
            self.closed.append(request_id)


async def _read(client: PacedEngineClient, params: SamplingParams) -> list[tuple[float, Out]]:
    t0 = time.monotonic()
    return [(time.monotonic() - t0, o) async for o in client.generate("p", params, "r1")]


def test_stream_reads_at_most_once_per_interval_and_loses_nothing() -> None:
    engine = FakeEngine(steps=40, step_s=0.005)
    got = asyncio.run(_read(PacedEngineClient(engine, 0.05), STREAM))
    tokens = [t for _, o in got for t in o.tokens]
    assert tokens == list(range(40))  # merged, in order, none lost or repeated
    assert got[0][1].tokens == [0]  # the first token is handed out at once
    assert got[-1][1].finished
    assert len(got) < 40 // 3  # several steps per output
    gaps = [b[0] - a[0] for a, b in zip(got, got[1:], strict=False)]
    assert min(gaps) >= 0.045


def test_the_stream_ends_at_once_after_the_final_output() -> None:
    """No pause after a finished output: the pacer's sleep (0.5 s here) would show as a gap."""
    engine = FakeEngine(steps=3, step_s=0.01)

    async def scenario() -> tuple[list[list[int]], float]:
        outs = []
        last = 0.0
        async for o in PacedEngineClient(engine, 0.5).generate("p", STREAM, "r1"):
            outs.append(o.tokens)
            last = time.monotonic()
        return outs, time.monotonic() - last

    outs, tail = asyncio.run(scenario())
    assert outs == [[0], [1, 2]]  # the first token at once, the rest merged in one interval
    assert tail < 0.25, f"the stream ended {tail:.2f} s after its final output"


@pytest.mark.parametrize(("params", "interval"), [(FINAL, 0.05), (STREAM, 0.0)])
def test_unpaced_requests_pass_straight_through(params: SamplingParams, interval: float) -> None:
    engine = FakeEngine(steps=10, step_s=0.01)
    got = asyncio.run(_read(PacedEngineClient(engine, interval), params))
    assert [o.tokens for _, o in got] == [[i] for i in range(10)]


def test_closing_the_stream_early_closes_the_engines_generator() -> None:
    """vLLM aborts the request when its generator is closed; the pacer must pass that on."""
    engine = FakeEngine(steps=1000, step_s=0.005)

    async def scenario() -> list[str]:
        agen = PacedEngineClient(engine, 0.05).generate("p", STREAM, "r-gone")
        await agen.__anext__()
        await agen.__anext__()
        await agen.aclose()
        return list(engine.closed)

    assert asyncio.run(asyncio.wait_for(scenario(), 5)) == ["r-gone"]


def test_cancelling_while_paced_closes_the_engines_generator() -> None:
    engine = FakeEngine(steps=1000, step_s=0.005)

    async def scenario() -> list[str]:
        async def consume() -> None:
            async for _ in PacedEngineClient(engine, 10.0).generate("p", STREAM, "r-cancel"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)  # the consumer now sleeps out the 10 s interval
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return list(engine.closed)

    assert asyncio.run(asyncio.wait_for(scenario(), 5)) == ["r-cancel"]


def test_everything_else_is_the_engines() -> None:
    engine = FakeEngine(steps=1, step_s=0.0, errored=True)
    assert PacedEngineClient(engine, 0.05).errored is True
