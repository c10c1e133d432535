"""Send a request to a model deployment and turn its answer into an HTTP response.

The model answers with a head (status, stream flag, first bytes) and then raw SSE bytes, which are
relayed unparsed. Failures before the first byte become OpenAI-shaped errors; failures after it
become a final ``data: {"error": ...}`` event and ``[DONE]``, so a stream never just stops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
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
from serve_app.gateway.usage import Outcome
from serve_app.protocol import SSE_DONE, RequestContext, sse_event

logger = logging.getLogger("ray.serve")

_UNAVAILABLE = (DeploymentUnavailableError, ReplicaUnavailableError, RayActorError)

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# Called exactly once when a request ends, however it ends.
OnDone = Callable[[Outcome], Awaitable[None]]


async def _nothing(_: Outcome) -> None:
    return None


class Forwarder:
    """Calls model deployments through their handles (one handle per model id)."""

    def __init__(self, handles: Mapping[str, Any], cfg: GatewayConfig) -> None:
        self._handles = {
            model_id: h.options(stream=True) for model_id, h in handles.items()
        }
        self.cfg = cfg
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
        model_id: str,
        method: str,
        body: dict[str, Any],
        ctx: RequestContext,
        headers: dict[str, str],
        on_done: OnDone = _nothing,
    ) -> Response:
        """Call the model; ``on_done`` runs exactly once, however the request ends."""
        start = time.monotonic()
        try:
            response = await self._forward(model_id, method, body, ctx, headers, on_done, start)
        except errors.ServeAppError as exc:
            await on_done(Outcome(status=exc.status))
            raise
        except BaseException:
            await on_done(Outcome(status=499))  # the client went away before an answer
            raise
        return response

    async def _forward(
        self,
        model_id: str,
        method: str,
        body: dict[str, Any],
        ctx: RequestContext,
        headers: dict[str, str],
        on_done: OnDone,
        start: float,
    ) -> Response:
        handle = self._handles[model_id]
        gen = getattr(handle, method).remote(body, ctx.to_dict())
        self.transport = "object refs" if getattr(gen, "by_reference", True) else "grpc"
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                first = await gen.__anext__()
        except BackPressureError:
            raise self._unavailable(model_id, "at capacity") from None
        except _UNAVAILABLE:
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
            raise self._unavailable(model_id, "failing") from None

        ttft = time.monotonic() - start
        if first["stream"]:
            return StreamingResponse(
                self._relay(model_id, first["body"], gen, on_done, start, ttft),
                media_type="text/event-stream",
                headers={**headers, **STREAM_HEADERS},
            )
        gen.cancel()  # the answer is complete; release the stream promptly
        await on_done(Outcome(status=first["status"], usage=first.get("usage"),
                              ttft_s=None, duration_s=ttft))
        return Response(
            first["body"], status_code=first["status"], media_type="application/json", headers=headers
        )

    async def _relay(
        self, model_id: str, first: bytes, gen: Any, on_done: OnDone, start: float, ttft: float
    ) -> AsyncIterator[bytes]:
        finished = False
        usage: dict[str, Any] | None = None
        events = first.count(b"data: ")
        try:
            if first:
                yield first
            while True:
                try:
                    async with asyncio.timeout(self.cfg.stream_idle_timeout_s):
                        chunk = await gen.__anext__()
                except StopAsyncIteration:
                    finished = True
                    return
                if isinstance(chunk, dict):  # the trailer: accounting only, never relayed
                    usage = chunk.get("usage")
                    continue
                events += chunk.count(b"data: ")
                yield chunk
        except (asyncio.CancelledError, GeneratorExit, RequestCancelledError):
            raise
        except Exception as exc:
            if isinstance(exc, TimeoutError):
                err: errors.ServeAppError = errors.GatewayTimeout(
                    f"model {model_id!r} sent nothing for {self.cfg.stream_idle_timeout_s:.0f} s"
                )
            else:
                logger.error("stream from %s broke: %s", model_id, exc.__class__.__name__)
                err = self._unavailable(model_id, "unavailable")
            gen.cancel()  # stop the model's work before telling the client
            finished = True
            yield sse_event(json.dumps(err.to_body()).encode()) + SSE_DONE
        finally:
            if not finished:
                gen.cancel()
            # Runs even when the client went away mid-stream: a task, since this frame may be
            # closing under cancellation.
            outcome = Outcome(status=200, usage=usage, events=events, ttft_s=ttft,
                              duration_s=time.monotonic() - start)
            task = asyncio.get_running_loop().create_task(on_done(outcome))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
