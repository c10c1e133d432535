"""Pace a streamed request so vLLM merges its tokens before its serving layer formats them.

vLLM's AsyncLLM keeps one output slot per request and, when streaming deltas, merges each new
engine step into that slot while nobody is reading it (``RequestOutputCollector``). Reading at
most once per interval therefore turns several engine steps into one ``RequestOutput``, so vLLM's
own OpenAI serving layer builds, serialises and sends one SSE event per interval instead of one
per token. The text, token ids, logprobs and finish reasons are merged by vLLM itself; nothing here
parses or rewrites them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from serve_app.engine.clients import current_meter


class PacedEngineClient:
    """An engine client whose streamed ``generate`` hands out at most one output per interval.

    Everything else is the wrapped engine's. The first output (which carries the first token) is
    handed out at once; a finished output ends the stream. Each output of a streamed request is
    counted in the request's ``TokenMeter`` (``clients.current_meter``), so a stream that ends
    early still knows how many tokens the engine made. Requests that are not streamed
    (``output_kind`` other than ``DELTA``) are passed through untouched.
    """

    def __init__(self, engine: Any, interval_s: float) -> None:
        self._engine = engine
        self.interval_s = interval_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
    ) -> AsyncIterator[Any]:
        outputs = self._engine.generate(prompt, sampling_params, request_id, *args, **kwargs)
        kind = getattr(getattr(sampling_params, "output_kind", None), "name", None)
        streamed = kind == "DELTA"
        pace = self.interval_s > 0 and streamed
        meter = current_meter.get() if streamed else None
        try:
            async for out in outputs:
                handed = time.monotonic()
                if meter is not None:
                    meter.add(out)
                yield out
                if pace and not getattr(out, "finished", False):
                    # While we sleep, the engine merges its next steps into this request's slot.
                    wait = handed + self.interval_s - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
        finally:
            # Closing vLLM's generator early (client gone, consumer closed) aborts the request in
            # the engine; on a normal end it is already finished and this does nothing.
            await outputs.aclose()
