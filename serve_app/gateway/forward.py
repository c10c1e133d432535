"""Send a request to a model deployment and turn its answer into an HTTP response.

The model answers with a head (status, stream flag, first bytes) and then, for a stream, chunks of
raw SSE bytes (relayed unparsed) and a trailer (see ``protocol``). A failure before the first byte
raises an OpenAI-shaped error for the pipeline to close the request's ledger with; once an answer
exists, this module closes the ledger when it ends. A failure after the first byte becomes a final
error event in the endpoint's stream format (``protocol.stream_error``), so a stream never just
stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
    RequestCancelledError,
)
from starlette.responses import Response, StreamingResponse

from serve_app import errors
from serve_app.config import GatewayConfig
from serve_app.gateway.drain import Drain
from serve_app.gateway.ledger import Ledger, Outcome
from serve_app.gateway.outage import ModelDown, OutageGuard
from serve_app.protocol import Endpoint, Head, RequestContext, Tokens, stream_error, tokens_of

logger = logging.getLogger("ray.serve")

_UNAVAILABLE = (DeploymentUnavailableError, ReplicaUnavailableError, RayActorError)

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Forwarder:
    """Calls model deployments through their handles (one handle per model id)."""

    def __init__(
        self, handles: Mapping[str, Any], cfg: GatewayConfig, outage: OutageGuard | None = None,
        drain: Drain | None = None,
    ) -> None:
        self._handles = {
            model_id: h.options(stream=True) for model_id, h in handles.items()
        }
        self.cfg = cfg
        self.outage = outage if outage is not None else OutageGuard(cfg.unavailable_hold_s, None)
        self.drain = drain if drain is not None else Drain(cfg.drain_timeout_s, None)
        self._pending: set[asyncio.Task[None]] = set()
        # How the last call travelled: "grpc" (Ray Serve's throughput mode) or "object refs"
        # (Ray's default). In the replica's diagnostics (serve-app diagnose); a test checks it.
        self.transport = "none yet"

    def _unavailable(self, model_id: str, why: str) -> errors.ServiceUnavailable:
        return errors.ServiceUnavailable(
            f"model {model_id!r} is {why}; retry shortly",
            retry_after_s=self.cfg.retry_after_s,
        )

    async def forward(
        self,
        ledger: Ledger,
        endpoint: Endpoint,
        body: dict[str, Any],
        ctx: RequestContext,
        headers: dict[str, str],
    ) -> Response:
        """Call ``ledger.model_id``. Raises ``ServeAppError`` if no answer came (the ledger stays
        open); otherwise the ledger is closed here once the answer ends, however it ends."""
        start = time.monotonic()
        model_id = ledger.model_id
        if self.drain.draining:
            raise errors.ServiceUnavailable("the server is shutting down; retry shortly",
                                            retry_after_s=self.cfg.retry_after_s)
        gen = self._handles[model_id].handle.remote(endpoint.name, body, ctx.to_dict())
        self.transport = "object refs" if getattr(gen, "by_reference", True) else "grpc"
        first = await self._first(model_id, gen, start)
        ttft = time.monotonic() - start
        if first["status"] == 503 and not first["stream"]:
            # The replica's engine died (engine/watchdog.py): nothing ran. A ServiceUnavailable
            # lets the pipeline fall back, or answer 503 with the gateway's Retry-After.
            gen.cancel()
            self.outage.saw_failure(model_id)
            raise self._unavailable(model_id, "restarting its engine")
        if first["stream"]:
            return StreamingResponse(
                self._relay(ledger, endpoint, first, gen, start, ttft),
                media_type="text/event-stream",
                headers={**headers, **STREAM_HEADERS},
            )
        answer: bytes = first["body"]
        if first.get("parts"):
            answer = await self._rest(model_id, gen, first)
        gen.cancel()  # the answer is complete; release the stream promptly
        tokens = first["tokens"] if first["tokens"] is not None else tokens_of(0, 0)
        await ledger.close(Outcome(first["status"], tokens, ttft_s=None, duration_s=ttft))
        return Response(
            answer, status_code=first["status"], media_type="application/json", headers=headers
        )

    async def _rest(self, model_id: str, gen: Any, first: Head) -> bytes:
        """A complete answer sent in parts (``protocol.split_complete``): the head's bytes and the
        ``parts`` that follow it."""
        parts = [first["body"]]
        try:
            async with asyncio.timeout(self.cfg.stream_idle_timeout_s):
                for _ in range(first["parts"]):
                    part = await gen.__anext__()
                    if not isinstance(part, bytes):
                        raise TypeError(f"expected an answer part, got {type(part).__name__}")
                    parts.append(part)
        except BaseException as exc:
            gen.cancel()
            if isinstance(exc, Exception):
                logger.error("answer from %s broke after its head: %s", model_id,
                             exc.__class__.__name__)
                raise self._unavailable(model_id, "unavailable") from None
            raise
        return b"".join(parts)

    async def _first(self, model_id: str, gen: Any, start: float) -> Head:
        """The model's head, or the error that stands for no answer. A model with no healthy
        replica holds the request at most ``unavailable_hold_s`` (outage.py)."""
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                first: Head = await self.outage.first(model_id, gen.__anext__(), start)
                return first
        except BackPressureError:
            raise self._unavailable(model_id, "at capacity") from None
        except ModelDown:
            gen.cancel()
            raise self._unavailable(model_id, "down (no healthy replica)") from None
        except _UNAVAILABLE:
            self.outage.saw_failure(model_id)
            raise self._unavailable(model_id, "unavailable") from None
        except TimeoutError:
            gen.cancel()
            raise errors.GatewayTimeout(
                f"model {model_id!r} did not answer within {self.cfg.request_timeout_s:.0f} s"
            ) from None
        except StopAsyncIteration:
            raise errors.InternalError(f"model {model_id!r} returned no answer") from None
        except RayTaskError as exc:
            logger.error("model %s failed: %s", model_id, exc.__class__.__name__)
            self.outage.saw_failure(model_id)
            raise self._unavailable(model_id, "failing") from None
        except BaseException:
            gen.cancel()  # the client went away (or this task was cancelled) before an answer
            raise

    async def _relay(
        self, ledger: Ledger, endpoint: Endpoint, first: Head, gen: Any, start: float, ttft: float
    ) -> AsyncIterator[bytes]:
        model_id = ledger.model_id
        finished = False
        # The engine's counts so far: the head has the prompt's, each chunk the completion's, and
        # the trailer the final ones. A stream cut short is charged what the last chunk said.
        so_far = first["tokens"] or tokens_of(0, 0)
        prompt, completion = so_far["prompt_tokens"], so_far["completion_tokens"]
        final: Tokens | None = None
        stream = self.drain.track(gen.cancel)  # a graceful stop ends it cleanly (drain.py)
        try:
            if first["body"]:
                yield first["body"]
            while True:
                try:
                    async with asyncio.timeout(self.cfg.stream_idle_timeout_s):
                        item = await gen.__anext__()
                except StopAsyncIteration:
                    finished = True
                    return
                if isinstance(item, dict):  # the trailer: accounting only, never relayed
                    final = item["tokens"]
                    continue
                data, completion = item
                yield data
        except (asyncio.CancelledError, RequestCancelledError):
            if not stream.stopped:
                raise  # the client went away
            finished = True  # the app is stopping and the drain's time is up
            yield stream_error(endpoint, errors.ServiceUnavailable(
                "the server is shutting down; retry shortly", retry_after_s=self.cfg.retry_after_s))
        except GeneratorExit:
            raise
        except Exception as exc:
            if isinstance(exc, TimeoutError):
                err: errors.ServeAppError = errors.GatewayTimeout(
                    f"model {model_id!r} sent nothing for {self.cfg.stream_idle_timeout_s:.0f} s"
                )
            else:
                logger.error("stream from %s broke: %s", model_id, exc.__class__.__name__)
                self.outage.saw_failure(model_id)
                err = self._unavailable(model_id, "unavailable")
            gen.cancel()  # stop the model's work before telling the client
            finished = True
            yield stream_error(endpoint, err)
        finally:
            self.drain.done(stream)
            if not finished:
                gen.cancel()
            out = Outcome(200, final or tokens_of(prompt, completion), ttft_s=ttft,
                          duration_s=time.monotonic() - start)
            # Runs even when the client went away mid-stream: a task, since this frame may be
            # closing under cancellation.
            task = asyncio.get_running_loop().create_task(ledger.close(out))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
