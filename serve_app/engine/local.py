"""A model served inside the gateway's own process (``gateway.serve_model``, the in-gateway path).

On the deployment path every token crosses the model replica's serving layer, Ray Serve's gRPC
stream to the gateway, the gateway's relay and the gateway's HTTP server: two Python processes per
chunk. Here the gateway replica builds the model's ``ModelServer`` in its own process, and the
forwarder calls it exactly as it calls a deployment handle
(``handle.options(stream=True).handle.remote(endpoint, body, ctx)``, an async iterator of a head
and the answer's bytes, with ``cancel()``), so the pipeline (auth, limits, flow queue, fallback,
ledger) is the same code on both paths. Measured with ``python -m loadtests.bench`` in
docs/PERFORMANCE.md ("The in-gateway path").

``app.py`` passes ``start`` to the gateway (the gateway does not import the engine package).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from serve_app.engine.deployment import ModelServer

logger = logging.getLogger("ray.serve")


class LocalStream:
    """One call's answer: what a streaming ``DeploymentResponseGenerator`` gives the forwarder."""

    transport = "in process"
    by_reference = False

    def __init__(self, answer: AsyncIterator[Any]) -> None:
        self._answer = answer

    def __aiter__(self) -> LocalStream:
        return self

    def __anext__(self) -> Any:
        return self._answer.__anext__()

    def cancel(self) -> None:
        """Stop the answer: closing the generator aborts its request in the engine. The forwarder
        cancels from inside the event loop, between reads, as it does a handle's stream."""
        aclose = getattr(self._answer, "aclose", None)
        if aclose is not None:
            task = asyncio.get_running_loop().create_task(aclose())
            task.add_done_callback(_log_failure)


def _log_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("closing an in-gateway answer failed: %r", task.exception())


class _Method:
    def __init__(self, server: Any) -> None:
        self._server = server

    def remote(self, endpoint: str, body: dict[str, Any], ctx: dict[str, Any]) -> LocalStream:
        # A shallow copy, as a handle's serialisation would give: the model server may change
        # the body's top level, and the gateway may send the same body to a fallback.
        return LocalStream(self._server.handle(endpoint, dict(body), ctx))


class LocalModel:
    """The model's ``ModelServer`` in this process, shaped like its deployment handle."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.handle = _Method(server)

    def options(self, **_: Any) -> LocalModel:
        return self

    async def check_health(self) -> None:
        await self.server.check_health()

    async def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.server.stats()
        return result

    def shutdown(self) -> None:
        self.server.__del__()


async def start(model: dict[str, Any], cache_dir: str, top_priority: int) -> LocalModel:
    """Build and start the model's server here (bounded by its ``startup_timeout_s``)."""
    impl: Any = getattr(ModelServer, "func_or_class", ModelServer)  # the class under @serve.deployment
    server = impl.__new__(impl)
    await server.__init__(model, cache_dir, top_priority)
    return LocalModel(server)
