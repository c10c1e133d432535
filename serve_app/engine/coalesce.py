"""SSE coalescing: one vLLM stream relayed as a ``Head``, ``Chunk`` tuples and a ``Trailer``.

The trailer (the engine's final counts) goes out as soon as they are known, which is before the
bytes carrying the answer's last events: agents close the connection on those, and the gateway must
not have to wait for anything after them (or a whole answer in one burst has them in its head).

The pacing happens upstream (``pacing.PacedEngineClient``): each engine output becomes a burst of
SSE strings in vLLM's serving layer (role and first token; last token, usage and ``[DONE]``), and a
burst travels as one message, with the completion tokens the engine has made so far (the request's
``TokenMeter``). The relay itself never holds bytes back.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from serve_app import errors
from serve_app.engine.clients import TokenMeter
from serve_app.protocol import (
    Chunk,
    Endpoint,
    Head,
    Trailer,
    head,
    stream_error,
    tokens_of,
    trailer,
    usage_tokens,
)

logger = logging.getLogger(__name__)

_END = object()


def to_sse(event: Any) -> str:
    """vLLM's Responses stream yields event objects; its own router frames them as SSE."""
    if isinstance(event, str):
        return event
    kind = getattr(event, "type", "unknown")
    return f"event: {kind}\ndata: {event.model_dump_json(indent=None, by_alias=True)}\n\n"


def _completed_usage(event: str) -> dict[str, Any] | None:
    """``response.usage`` of a Responses ``response.completed`` SSE event."""
    try:
        data = event.split("data: ", 1)[1]
        usage = json.loads(data)["response"]["usage"]
        return usage if isinstance(usage, dict) else None
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def _usage_of(event: str) -> dict[str, Any] | None:
    try:
        usage = json.loads(event.removeprefix("data: "))["usage"]
        return usage if isinstance(usage, dict) else None
    except (ValueError, KeyError, TypeError):
        return None


class Coalescer:
    """Relays one of vLLM's SSE streams as few messages: whatever is ready goes out as one.

    The usage chunk is read for the trailer (and dropped if the client did not ask for it); a
    stream that ends without one (an error) reports the meter's count. An exception from vLLM's
    stream becomes ``on_error``'s error, sent as the endpoint's stream error event.

    A pump task drains vLLM's generator into a queue. If the consumer is cancelled (the client
    went away) or closes the relay, the pump is cancelled too, which makes vLLM abort the request
    in the engine.
    """

    def __init__(
        self, meter: TokenMeter, on_error: Callable[[Exception], errors.ServeAppError], *,
        wants_usage: bool = True, endpoint: Endpoint | None = None, model: str = "",
    ) -> None:
        self._meter = meter
        self._on_error = on_error
        self._wants_usage = wants_usage
        self._endpoint = endpoint
        self._model = model
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._usage: dict[str, Any] | None = None

    async def relay(
        self, chunks: AsyncIterator[Any], context: contextvars.Context
    ) -> AsyncIterator[Head | Chunk | Trailer]:
        """Relay ``chunks``, read by a pump that runs in ``context`` (the request's, so that the
        ``generate`` calls vLLM makes as its stream is read see the request's meter)."""
        task = asyncio.create_task(self._pump(chunks), context=context)
        first = True
        counted = False  # the final counts have gone out (in the head or a trailer)
        try:
            while True:
                data, done = self._burst(await self._queue.get())
                final = usage_tokens(self._usage)
                if first:
                    # A whole answer in one burst: the head carries the final counts.
                    yield head(200, data, stream=True, tokens=final or tokens_of(
                        self._meter.prompt_tokens, self._meter.completion_tokens))
                    first, counted = False, final is not None
                    if done and not counted:
                        yield self._trailer()
                    if done:
                        return
                    continue
                if final is not None and not counted:
                    # The trailer goes BEFORE the bytes with the answer's last events (usage chunk
                    # and [DONE], response.completed, message_delta and message_stop): a client
                    # closes on those, and the gateway then has the counts already.
                    yield {"tokens": final}
                    counted = True
                if data:
                    yield data, self._meter.completion_tokens
                if done:
                    if not counted:
                        yield self._trailer()
                    return
        finally:
            if not task.done():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass

    async def _pump(self, chunks: AsyncIterator[Any]) -> None:
        try:
            async for chunk in chunks:
                self._queue.put_nowait(to_sse(chunk))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # surfaced to the client as an SSE error event
            logger.exception("stream failed for %s", self._model)
            self._queue.put_nowait(self._on_error(exc))
        self._queue.put_nowait(_END)

    def _burst(self, item: Any) -> tuple[bytes, bool]:
        """``item`` and whatever else is queued now, as one message; and whether the stream ended."""
        parts: list[bytes] = []
        while True:
            if item is _END:
                return b"".join(parts), True
            if isinstance(item, errors.ServeAppError):
                parts.append(stream_error(self._endpoint, item))
                return b"".join(parts), True
            if '"usage":{' in item and '"choices":[]' in item:
                self._usage = _usage_of(item)
                if not self._wants_usage:
                    item = ""
            elif item.startswith("event: response.completed"):
                # The Responses API's last event carries the engine's counts (input/output names).
                self._usage = _completed_usage(item) or self._usage
            elif item.startswith("event: message_delta") and '"usage":{' in item:
                # The Messages API's last delta carries them (input/output/cache names).
                self._usage = _usage_of(item.split("data: ", 1)[-1]) or self._usage
            if item:
                parts.append(item.encode())
            if self._queue.empty():
                return b"".join(parts), False
            item = self._queue.get_nowait()

    def _trailer(self) -> Trailer:
        counted = usage_tokens(self._usage)
        if counted is not None:
            return {"tokens": counted}
        return trailer(self._meter.prompt_tokens, self._meter.completion_tokens)
