"""A model served inside the gateway's own process (``gateway.serve_model``, the in-gateway path).

On the deployment path every token crosses the model replica's serving layer, Ray Serve's gRPC
stream to the gateway, the gateway's relay and the gateway's HTTP server: two Python processes per
chunk. Here the gateway replica builds the model's ``ModelService`` in its own process and calls it
through ``InProcessClient``, the second implementation of ``protocol.ModelClient`` (the first is
``gateway.forward.HandleClient``, over the deployment's Serve handle). The pipeline (auth, limits,
flow queue, fallback, the books) is the same code on both paths. Measured with
``python -m loadtests.bench`` in docs/PERFORMANCE.md ("The in-gateway path").

``app.py`` passes ``start`` to the gateway (the gateway does not import the engine package).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from serve_app.engine.deployment import ModelService

logger = logging.getLogger("ray.serve")


class Service(Protocol):
    """What this module calls of a ``ModelService`` (tests give a stand-in)."""

    def handle(self, endpoint: str, body: dict[str, Any], ctx: dict[str, Any]) -> AsyncIterator[Any]: ...
    def stats(self) -> dict[str, Any]: ...
    async def check_health(self) -> None: ...
    def shutdown(self) -> None: ...


class LocalCall:
    """One call's answer (``protocol.ModelCall``): the service's own async generator."""

    def __init__(self, answer: AsyncIterator[Any]) -> None:
        self._answer = answer
        self._closing: asyncio.Task[None] | None = None

    def __anext__(self) -> Any:
        return self._answer.__anext__()

    def cancel(self) -> None:
        """Stop the answer: closing the generator aborts its request in the engine. Called from
        inside the event loop, between reads; a second call does nothing."""
        aclose = getattr(self._answer, "aclose", None)
        if aclose is not None and self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(aclose())
            self._closing.add_done_callback(_log_failure)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("closing an in-gateway answer failed: %r", task.exception())


class InProcessClient:
    """``protocol.ModelClient`` over a ``ModelService`` in this process, plus the health, stats
    and shutdown that the gateway replica reports and owns for it."""

    transport = "in process"

    def __init__(self, service: Service) -> None:
        self.service = service

    def call(self, endpoint: str, body: dict[str, Any], ctx: dict[str, Any]) -> LocalCall:
        # A shallow copy, as a handle's serialisation would give: the model may change the body's
        # top level, and the gateway may send the same body to a fallback.
        return LocalCall(self.service.handle(endpoint, dict(body), ctx))

    async def check_health(self) -> None:
        await self.service.check_health()

    async def stats(self) -> dict[str, Any]:
        return self.service.stats()

    def shutdown(self) -> None:
        self.service.shutdown()


async def start(model: dict[str, Any], cache_dir: str, top_priority: int) -> InProcessClient:
    """Build and start the model's service here (bounded by its ``startup_timeout_s``)."""
    return InProcessClient(await ModelService.create(model, cache_dir, top_priority))
