"""serve_app.engine.pacing: a paced stream against a fake engine that merges like vLLM's collector."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
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


class Collector:
    """vLLM's RequestOutputCollector in small: ``put`` merges into the pending output while nobody
    reads it; ``get`` takes it."""

    def __init__(self) -> None:
        self.output: Out | None = None
        self.ready = asyncio.Event()

    def put(self, out: Out) -> None:
        if self.output is None:
            self.output = out
            self.ready.set()
        else:
            self.output = Out(self.output.tokens + out.tokens, out.finished)

    async def get(self) -> Out:
        while self.output is None:
            await self.ready.wait()
        out, self.output = self.output, None
        self.ready.clear()
        return out


@dataclass
class Books:
    """AsyncLLM's ``output_processor``: requests in flight by internal id, internal ids by external."""

    external_req_ids: dict[str, list[str]] = field(default_factory=dict)
    request_states: dict[str, SimpleNamespace] = field(default_factory=dict)


@dataclass
class FakeEngine:
    """Produces one token per step into the request's collector, as vLLM's output handler does
    (a finished request leaves the books at once, as in vLLM's output processor)."""

    steps: int
    step_s: float
    errored: bool = False
    closed: list[str] = field(default_factory=list)
    books: Books = field(default_factory=Books)
    keeps_books: bool = True  # False: no ``output_processor`` for the pacer to find

    @property
    def output_processor(self) -> Books:
        if not self.keeps_books:
            raise AttributeError("output_processor")
        return self.books

    async def generate(self, prompt: Any, params: Any, request_id: str, **_: Any) -> AsyncIterator[Out]:
        q = Collector()
        internal = f"{request_id}-0a1b"
        self.books.external_req_ids[request_id] = [internal]
        self.books.request_states[internal] = SimpleNamespace(queue=q)

        async def produce() -> None:
            for i in range(self.steps):
                await asyncio.sleep(self.step_s)
                if i == self.steps - 1:
                    del self.books.request_states[internal]
                    del self.books.external_req_ids[request_id]
                q.put(Out([i], i == self.steps - 1))

        task = asyncio.create_task(produce())
        try:
            while True:
                out = await q.get()
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
    # Every output but the final one waits out the interval; the final one ends the pause at once
    # (EndWatch), so the last gap may be any length (CI: 2 ms when the end fell just after a read).
    assert min(gaps[:-1]) >= 0.045


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


@pytest.mark.parametrize("books", [True, False])
def test_the_final_output_is_not_held_for_the_rest_of_the_interval(books: bool) -> None:
    """The pause ends when the request's last output reaches its collector (``EndWatch``), not at
    the interval's end; an engine that keeps no books (``books`` False) is paced by the clock."""
    engine = FakeEngine(steps=3, step_s=0.01, keeps_books=books)

    async def scenario() -> tuple[list[list[int]], float]:
        t0 = time.monotonic()
        outs = [o.tokens async for o in PacedEngineClient(engine, 0.5).generate("p", STREAM, "r1")]
        return outs, time.monotonic() - t0

    outs, took = asyncio.run(scenario())
    assert outs == [[0], [1, 2]]  # still merged: the early wake-up comes at the final step only
    if books:
        assert took < 0.25, f"the final output came {took:.2f} s after the start (interval 0.5 s)"
    else:
        assert took >= 0.45


def test_the_books_read_are_vllms() -> None:
    """The names ``collector_of`` and ``EndWatch`` use, checked against vLLM's own code (an upgrade
    that moves them fails here, not as streams that end an interval late)."""
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector, RequestState

    init = inspect.getsource(OutputProcessor.__init__)
    assert "self.external_req_ids" in init and "self.request_states" in init
    assert "queue" in inspect.signature(RequestState.__init__).parameters
    assert "self.output_processor = " in inspect.getsource(AsyncLLM.__init__)
    q = RequestOutputCollector(RequestOutputKind.DELTA, "r")
    assert q.output is None and callable(q.put)
    q.put = q.put  # an instance attribute may replace it (no __slots__)


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
