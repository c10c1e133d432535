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
from serve_app.gateway.ledger import Ledger, Outcome
from serve_app.gateway.replicas import LiveReplicas
from serve_app.protocol import Endpoint, Head, RequestContext, Tokens, stream_error, tokens_of

logger = logging.getLogger("ray.serve")

_UNAVAILABLE = (DeploymentUnavailableError, ReplicaUnavailableError, RayActorError)

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Forwarder:
    """Calls model deployments through their handles (one handle per model id)."""

    def __init__(self, handles: Mapping[str, Any], cfg: GatewayConfig,
                 replicas: LiveReplicas | None = None) -> None:
        self._handles = {
            model_id: h.options(stream=True) for model_id, h in handles.items()
        }
        self.cfg = cfg
        self._replicas = replicas
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
        gen = self._handles[model_id].handle.remote(endpoint.name, body, ctx.to_dict())
        self.transport = "object refs" if getattr(gen, "by_reference", True) else "grpc"
        first = await self._first(model_id, gen)
        ttft = time.monotonic() - start
        if first["stream"]:
            return StreamingResponse(
                self._relay(ledger, endpoint, first, gen, start, ttft),
                media_type="text/event-stream",
                headers={**headers, **STREAM_HEADERS},
            )
        gen.cancel()  # the answer is complete; release the stream promptly
        tokens = first["tokens"] if first["tokens"] is not None else tokens_of(0, 0)
        await ledger.close(Outcome(first["status"], tokens, ttft_s=None, duration_s=ttft))
        return Response(
            first["body"], status_code=first["status"], media_type="application/json", headers=headers
        )

    async def _first(self, model_id: str, gen: Any) -> Head:
        """The model's head, or the error that stands for no answer."""
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                return await self._head(model_id, gen)
        except errors.ServiceUnavailable:
            gen.cancel()
            raise
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
        except BaseException:
            gen.cancel()  # the client went away (or this task was cancelled) before an answer
            raise

    async def _head(self, model_id: str, gen: Any) -> Head:
        """The model's head. A request that Ray Serve holds for a replica that is gone (its node
        lost) would wait until a new one runs; once the model has had no running replica for
        ``no_replica_wait_s``, it is answered 503 instead."""
        if self._replicas is None:
            first: Head = await gen.__anext__()
            return first
        head = asyncio.ensure_future(gen.__anext__())
        none_since: float | None = None
        try:
            while True:
                done, _ = await asyncio.wait({head}, timeout=0.5)
                if done:
                    return head.result()  # type: ignore[no-any-return]
                if self._replicas.running(model_id) != 0:
                    none_since = None
                    continue
                now = time.monotonic()
                none_since = now if none_since is None else none_since
                if now - none_since >= self.cfg.no_replica_wait_s:
                    raise self._unavailable(model_id, "without a running replica")
        finally:
            if not head.done():
                head.cancel()

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
            yield stream_error(endpoint, err)
        finally:
            if not finished:
                gen.cancel()
            out = Outcome(200, final or tokens_of(prompt, completion), ttft_s=ttft,
                          duration_s=time.monotonic() - start)
            # Runs even when the client went away mid-stream: a task, since this frame may be
            # closing under cancellation.
            task = asyncio.get_running_loop().create_task(ledger.close(out))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
