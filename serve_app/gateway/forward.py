"""Send a request to a model through its ``ModelClient`` and turn the model's answer into an ``Answer``.

The model answers with a head (status, stream flag, first bytes) and then, for a stream, chunks of
raw SSE bytes (relayed unparsed) and a trailer (see ``protocol``). When no whole answer comes, an
OpenAI-shaped error is raised for the pipeline to close the request's pass with:
``ServiceUnavailable`` when nothing ran (the pipeline may fall back), ``AnswerBroken`` when a
complete answer broke off after its head (the model ran). Otherwise the request's end belongs to
this module: a complete answer exits the pass before it is returned, and a stream's ``Answer``
carries a ``finish`` that its consumer awaits however its reading ended (``Relay.end``). A failure
mid-stream becomes a final error event in the endpoint's stream format (``protocol.stream_error``),
so a stream never just stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from serve_app import errors
from serve_app.config import HttpConfig
from serve_app.gateway.admission.drain import Drain, Stream
from serve_app.gateway.admission.ledger import Outcome, Pass
from serve_app.gateway.outage import ModelDown, OutageGuard
from serve_app.protocol import (
    Answer,
    Endpoint,
    Head,
    ModelCall,
    ModelClient,
    RequestContext,
    Tokens,
    stream_error,
    tokens_of,
)

logger = logging.getLogger("ray.serve")

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Forwarder:
    """Calls models through their clients (one ``ModelClient`` per model id)."""

    def __init__(
        self, clients: Mapping[str, ModelClient], cfg: HttpConfig,
        outage: OutageGuard | None = None, drain: Drain | None = None,
    ) -> None:
        self._clients = dict(clients)
        self.cfg = cfg
        self.outage = outage if outage is not None else OutageGuard(cfg.unavailable_hold_s, None)
        self.drain = drain if drain is not None else Drain(cfg.drain_timeout_s, None)
        # How the last call travelled ("direct": routing.direct). In the replica's diagnostics
        # (serve-app diagnose); a test checks it.
        self.transport = "none yet"

    def unavailable(self, message: str) -> errors.ServiceUnavailable:
        """A 503 with the gateway's one ``Retry-After`` (``gateway.http.retry_after_s``)."""
        return errors.ServiceUnavailable(message, retry_after_s=self.cfg.retry_after_s)

    def model_unavailable(self, model_id: str, why: str) -> errors.ServiceUnavailable:
        return self.unavailable(f"model {model_id!r} is {why}; retry shortly")

    async def probe(self, model_id: str, endpoint: Endpoint, body: dict[str, Any],
                    ctx: RequestContext, timeout_s: float) -> tuple[int, bytes]:
        """One call outside admission and the books (the admin API tries a new adapter on one
        replica): its head's status and body; the rest of the answer is dropped. A 503 when no
        replica answers within ``timeout_s``."""
        client = self._clients.get(model_id)
        if client is None:
            raise self.model_unavailable(model_id, "not deployed")
        call = client.call(endpoint.name, body, ctx.to_dict())
        try:
            first = await asyncio.wait_for(call.__anext__(), timeout_s)
        except TimeoutError:
            raise self.model_unavailable(model_id, f"not answering within {timeout_s:.0f} s") from None
        finally:
            call.cancel()
        return int(first["status"]), bytes(first["body"])

    async def forward(
        self,
        admitted: Pass,
        endpoint: Endpoint,
        body: dict[str, Any],
        ctx: RequestContext,
        headers: dict[str, str],
    ) -> Answer:
        """Call ``admitted.model_id``. Raises ``ServeAppError`` if no whole answer came (the pass
        stays open for the caller: ``ServiceUnavailable`` when nothing ran, ``AnswerBroken`` when a
        complete answer broke off after its head); otherwise returns an ``Answer`` that owns the
        pass's exit (done already for a complete answer, by its ``finish`` for a stream)."""
        start = time.monotonic()
        model_id = admitted.model_id
        client = self._clients[model_id]
        gen = client.call(endpoint.name, body, ctx.to_dict())
        self.transport = client.transport
        first = await self._first(model_id, gen, start)
        if first["status"] == 503 and not first["stream"]:
            # The replica's engine died (engine/watchdog.py): nothing ran. A ServiceUnavailable
            # lets the pipeline fall back, or answer 503 with the gateway's Retry-After.
            gen.cancel()
            self.outage.saw_failure(model_id)
            raise self.model_unavailable(model_id, "restarting its engine")
        clock = admitted.clock
        timing = first.get("timing")
        if timing is not None:  # the replica's start and first item split Ray's queue from the engine
            clock.mark("handle", at=timing["start"])
            clock.mark("engine", at=timing["first"])
        headers = {**headers, "Server-Timing": clock.server_timing()}
        if first["stream"]:
            relay = Relay(self, admitted, endpoint, first, gen)
            return relay.answer({**headers, **STREAM_HEADERS})
        try:
            answer = await self._rest(model_id, gen, first) if first.get("parts") else first["body"]
        finally:
            gen.cancel()  # the answer is complete (or broken); release the stream promptly
        clock.mark("relay")
        tokens = first["tokens"] if first["tokens"] is not None else tokens_of(0, 0)
        await admitted.exit(Outcome(first["status"], tokens, ttft_s=None, duration_s=clock.elapsed_s()))
        return Answer(first["status"], headers, body=answer)

    async def _rest(self, model_id: str, gen: ModelCall, first: Head) -> bytes:
        """A complete answer sent in parts (``protocol.split_complete``): the head's bytes and the
        ``parts`` that follow it. Raises ``AnswerBroken`` if they stop coming: the model ran."""
        parts = [first["body"]]
        try:
            async with asyncio.timeout(self.cfg.stream_idle_timeout_s):
                for _ in range(first["parts"]):
                    part = await gen.__anext__()
                    if not isinstance(part, bytes):
                        raise TypeError(f"expected an answer part, got {type(part).__name__}")
                    parts.append(part)
        except Exception as exc:
            logger.error("answer from %s broke after its head: %s", model_id,
                         exc.__class__.__name__)
            raise errors.AnswerBroken(
                f"the answer of model {model_id!r} broke off; retry the request"
            ) from None
        return b"".join(parts)

    async def _first(self, model_id: str, gen: ModelCall, start: float) -> Head:
        """The model's head, or the error that stands for no answer. A model with no healthy
        replica holds the request at most ``unavailable_hold_s`` (outage.py)."""
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                first: Head = await self.outage.first(model_id, gen.__anext__(), start)
                return first
        except ModelDown:
            gen.cancel()
            raise self.model_unavailable(model_id, "down (no healthy replica)") from None
        except ConnectionError:  # the replica's connection broke before its head
            self.outage.saw_failure(model_id)
            raise self.model_unavailable(model_id, "unavailable") from None
        except TimeoutError:
            gen.cancel()
            raise errors.GatewayTimeout(
                f"model {model_id!r} did not answer within {self.cfg.request_timeout_s:.0f} s"
            ) from None
        except StopAsyncIteration:
            raise errors.InternalError(f"model {model_id!r} returned no answer") from None
        except BaseException:
            gen.cancel()  # the client went away (or this task was cancelled) before an answer
            raise


class Relay:
    """One model stream on its way to the client, and what it has told of its tokens so far."""

    def __init__(self, fwd: Forwarder, admitted: Pass, endpoint: Endpoint, first: Head,
                 gen: ModelCall) -> None:
        self._fwd = fwd
        self._admitted = admitted
        self._endpoint = endpoint
        self._first = first
        self._gen = gen
        # Time to first token as the client sees it: from the arrival at the front door to the
        # first bytes handed to the server for the client (``written``, by the answer's consumer).
        self._ttft: float | None = None
        self.finished = False  # the model's stream ended (or was cancelled by the relay itself)
        # The engine's counts so far: the head has the prompt's, each chunk the completion's, and
        # the trailer the final ones. A stream cut short is charged what the last chunk said.
        so_far = first["tokens"] or tokens_of(0, 0)
        self._prompt, self._completion = so_far["prompt_tokens"], so_far["completion_tokens"]
        # The trailer comes before the bytes of the answer's last events (coalesce.py), so a client
        # that closes on those has left the counts read already.
        self._final: Tokens | None = None
        # In flight from the head on: a graceful stop ends it cleanly (drain.py).
        self._stream: Stream = fwd.drain.track(gen.cancel)
        self._books: asyncio.Future[None] | None = None  # the pass's one exit (``_close``)
        self._chunks: AsyncGenerator[bytes, None] | None = None

    def answer(self, headers: dict[str, str]) -> Answer:
        """The stream as an ``Answer``: its events are ``chunks``, its ``finish`` is ``finish``,
        and its consumer says when the first bytes are out (``written``)."""
        self._chunks = self.chunks()
        return Answer(200, headers, events=self._chunks, finish=self.finish, written=self.written)

    def written(self) -> None:
        """The first bytes have left the gateway for the client: the ``relay`` stage and the time
        to first token end now (they include the gateway's own write, under load too)."""
        clock = self._admitted.clock
        if not clock.marked("relay"):
            self._ttft = clock.ttft_s(clock.mark("relay"))

    async def finish(self) -> None:
        """End the stream's request however its reading ended: close the events (a generator
        never started has no ``finally`` of its own to run), then ``end``."""
        try:
            if self._chunks is not None:
                await self._chunks.aclose()
        finally:
            await self.end()

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The SSE bytes for the client; the request's end is ``end``'s, not this generator's."""
        cfg, model_id, gen = self._fwd.cfg, self._admitted.model_id, self._gen
        try:
            if self._first["body"]:
                yield self._first["body"]
            while True:
                try:
                    async with asyncio.timeout(cfg.stream_idle_timeout_s):
                        item = await gen.__anext__()
                except StopAsyncIteration:
                    self.finished = True
                    return
                if isinstance(item, dict):  # the trailer: accounting only, never relayed
                    self._final = item["tokens"]
                    # The books are written before the answer's last events go out, so a client
                    # that has its whole answer is counted even if this process dies right after
                    # (a gateway SIGKILL lost the usage of streams that had just ended).
                    await self._close()
                    continue
                data, self._completion = item
                yield data
        except asyncio.CancelledError:
            if not self._stream.stopped:
                raise  # the client went away
            self.finished = True  # the app is stopping and the drain's time is up
            yield stream_error(self._endpoint,
                               self._fwd.unavailable("the server is shutting down; retry shortly"))
        except Exception as exc:
            if isinstance(exc, TimeoutError):
                err: errors.ServeAppError = errors.GatewayTimeout(
                    f"model {model_id!r} sent nothing for {cfg.stream_idle_timeout_s:.0f} s"
                )
            else:
                logger.error("stream from %s broke: %s", model_id, exc.__class__.__name__)
                self._fwd.outage.saw_failure(model_id)
                err = self._fwd.model_unavailable(model_id, "unavailable")
            gen.cancel()  # stop the model's work before telling the client
            self.finished = True
            yield stream_error(self._endpoint, err)

    async def end(self) -> None:
        """Stop the model's work if it is still going, and close the request's books."""
        self._fwd.drain.done(self._stream)
        if not self.finished:
            self._gen.cancel()
        await self._close()

    async def _close(self) -> None:
        """Close the request's books once: at the trailer (the engine's final counts), else at the
        stream's end with the counts the last chunk told."""
        if self._books is None:
            tokens = self._final or tokens_of(self._prompt, self._completion)
            self._books = asyncio.ensure_future(self._admitted.exit(Outcome(
                200, tokens, ttft_s=self._ttft, duration_s=self._admitted.clock.elapsed_s())))
        await asyncio.shield(self._books)
