"""A model replica's own streaming endpoint: the gateway's requests arrive here, not over Ray.

``ModelEndpoint`` listens on a free port of the replica's host and serves ``serve_app.wire``: one
request per connection, answered with ``ModelService.handle``'s items as frames. A request whose
token is not the application's (``runtime.registry``) is refused before its body is read further
than its frame. When the gateway closes the connection before the end (its client went away), the
request is cancelled, which aborts it in vLLM.

At most ``max_ongoing`` requests run at once (the deployment's ``max_ongoing_requests``, which Ray
Serve enforced when requests crossed its handles); the others wait here in arrival order, as they
waited in Ray Serve's queue, and that wait counts in the replica's TTFT and wait figures
(``ModelService.handle`` starts a request when it leaves the queue). ``in_flight`` counts the
requests taken here, waiting or running: it goes back to the gateway in each head (the affinity
router's load guard counts other gateways' requests with it) and to the autoscaling policy
(``record_autoscaling_stats``), since Ray Serve no longer sees these requests. ``drain``
stops taking requests (each is refused, and the gateway tries another replica: nothing ran) and
waits for those in flight, which is how a rolling update or a scale-down lets streams finish.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import orjson

from serve_app import wire

logger = logging.getLogger("ray.serve")
REQUEST_READ_TIMEOUT_S = 30.0
DRAIN_POLL_S = 0.2


class Handler(Protocol):
    def __call__(self, endpoint: str, body: dict[str, Any], ctx: dict[str, Any]) -> AsyncIterator[Any]: ...


def _well_formed(req: dict[str, Any]) -> bool:
    return (isinstance(req.get("endpoint"), str) and isinstance(req.get("body"), dict)
            and isinstance(req.get("ctx"), dict))


class ModelEndpoint:
    """Serves ``handle`` on ``host`` (a free port), checking each request's token."""

    def __init__(self, handle: Handler, token: Callable[[], str], host: str,
                 max_ongoing: int) -> None:
        self._handle = handle
        self._slots = asyncio.Semaphore(max_ongoing)
        self._token = token  # the registry's current token (it may change if the registry restarts)
        self.host = host
        self.port = 0
        self.in_flight = 0  # taken: waiting for a slot or running
        self.running = 0
        self.served = 0
        self.draining = False
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, 0,
                                                  limit=wire.MAX_FRAME_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]

    async def drain(self, timeout_s: float) -> int:
        """Take no more requests, and wait at most ``timeout_s`` for those in flight to end;
        returns how many were still going."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return self.in_flight

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            kind, payload = await asyncio.wait_for(wire.read_frame(reader), REQUEST_READ_TIMEOUT_S)
            if kind != wire.REQUEST:
                raise wire.WireError(f"expected a request frame, got {kind!r}")
            req = orjson.loads(payload)
            token = req.get("token") if isinstance(req, dict) else None
            refusal = ("token" if not isinstance(token, str)
                       or not hmac.compare_digest(token, self._token())
                       else "request" if not _well_formed(req)
                       else "draining" if self.draining else None)
            if refusal is not None:
                writer.write(wire.refused(refusal))
                writer.close()
                return
        except (OSError, EOFError, TimeoutError, ValueError, wire.WireError) as exc:
            logger.warning("model endpoint: bad request connection: %s", exc.__class__.__name__)
            writer.close()
            return
        self.in_flight += 1
        self.served += 1
        try:
            await self._answer(req, reader, writer)
        finally:
            self.in_flight -= 1
            writer.close()

    async def _answer(self, req: dict[str, Any], reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        """Write the answer's frames; the gateway's close (EOF) cancels it."""
        task = asyncio.current_task()
        assert task is not None
        answering = True

        def on_hang_up(f: asyncio.Future[bytes]) -> None:
            if answering and not f.cancelled():
                task.cancel()

        hung_up = asyncio.ensure_future(reader.read(1))  # the gateway sends nothing more: EOF
        hung_up.add_done_callback(on_hang_up)
        answer = self._handle(req["endpoint"], req["body"], req["ctx"])
        try:
            async with self._slots:  # a hang-up while it waits cancels it here
                self.running += 1
                try:
                    async for value in answer:
                        writer.write(wire.item(value, self.in_flight))
                        await writer.drain()
                finally:
                    self.running -= 1
            writer.write(wire.frame(wire.END, b""))
            await writer.drain()
        except asyncio.CancelledError:
            if not hung_up.done():
                raise  # this replica is stopping
            task.uncancel()  # our own cancel, for the gateway's hang-up
        except (ConnectionError, OSError):
            pass  # the gateway went away: the answer is closed below, which aborts it
        except Exception:
            logger.exception("model endpoint: answer failed")
        finally:
            answering = False
            hung_up.cancel()
            aclose = getattr(answer, "aclose", None)
            if aclose is not None:
                await aclose()
