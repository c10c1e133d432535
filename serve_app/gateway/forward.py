"""Send a request to a model deployment and turn its answer into an HTTP response.

The model answers with a head (status, stream flag, first bytes) and then raw SSE bytes, which are
relayed unparsed. Failures before the first byte become OpenAI-shaped errors; failures after it
become a final ``data: {"error": ...}`` event and ``[DONE]``, so a stream never just stops.
"""

from __future__ import annotations

import asyncio
import json
import logging
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
from serve_app.protocol import SSE_DONE, RequestContext, sse_event

logger = logging.getLogger("ray.serve")

_UNAVAILABLE = (DeploymentUnavailableError, ReplicaUnavailableError, RayActorError)

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Forwarder:
    """Calls model deployments through their handles (one handle per model id)."""

    def __init__(self, handles: Mapping[str, Any], cfg: GatewayConfig) -> None:
        self._handles = {
            model_id: h.options(stream=True) for model_id, h in handles.items()
        }
        self.cfg = cfg

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
    ) -> Response:
        handle = self._handles[model_id]
        gen = getattr(handle, method).remote(body, ctx.to_dict())
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

        if first["stream"]:
            return StreamingResponse(
                self._relay(model_id, first["body"], gen),
                media_type="text/event-stream",
                headers={**headers, **STREAM_HEADERS},
            )
        gen.cancel()  # the answer is complete; release the stream promptly
        return Response(
            first["body"], status_code=first["status"], media_type="application/json", headers=headers
        )

    async def _relay(self, model_id: str, first: bytes, gen: Any) -> AsyncIterator[bytes]:
        finished = False
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
            finished = True
            yield sse_event(json.dumps(err.to_body()).encode()) + SSE_DONE
        finally:
            if not finished:
                gen.cancel()
