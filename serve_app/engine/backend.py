"""The seam between the model deployment and what answers its requests: the ``Backend`` protocol.

``deployment.ModelServer`` (the Ray Serve replica) depends only on this protocol, as Ray Serve LLM's
``LLMServer`` depends only on its ``LLMEngine``. Two classes implement it:

- ``server.EngineServer``: one vLLM ``AsyncLLM`` and vLLM's own OpenAI serving objects;
- ``synthetic.SyntheticServer``: made-up tokens at a set rate, no engine (gateway benchmarks).

Both answer every request with the items of ``protocol.py`` (a ``Head``; for a large complete answer
its further ``bytes`` parts; for a stream its ``Chunk`` tuples and a ``Trailer``), so the gateway
cannot tell them apart. Neither needs Ray: a test builds one from a ``ModelConfig``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, TypedDict

from serve_app.protocol import Chunk, Endpoint, Head, RequestContext, Trailer

# One item of a model answer (protocol.py says in which order they come).
Answer = Head | bytes | Chunk | Trailer


class Diagnostics(TypedDict):
    """Facts about a backend for operators and tests (the deployment's ``stats``)."""

    unfinished_requests: int  # requests the engine holds now
    waiting_for_slot: int  # requests held in this replica until an engine slot is free
    streamed_tokens: int  # completion tokens made for streamed requests since start-up
    engine_dead: bool  # the engine died; the replica is about to be replaced


class Backend(Protocol):
    """What a model replica calls. A backend is built unstarted; ``start`` makes it ready."""

    async def start(self) -> None:
        """Load the model and make the backend ready to ``handle`` requests.

        Raises whatever start-up failed with (the replica then fails to start and Ray Serve
        retries it). The deployment bounds it with ``startup_timeout_s`` and, when that expires,
        cancels it and calls ``shutdown``, so a partial start must leave ``shutdown`` safe to call.
        """

    def handle(self, endpoint: Endpoint, body: dict[str, Any], ctx: RequestContext) -> AsyncIterator[Answer]:
        """Serve one request of ``endpoint`` with the gateway's parsed ``body`` and decisions.

        Yields a ``Head`` first, always. For a complete answer, ``Head.parts`` ``bytes`` items
        follow; for a stream (``Head.stream``), ``Chunk`` tuples and then one ``Trailer`` with the
        exact token counts. Errors never raise: a request that fails before its first byte is a
        ``Head`` with the error's status and body in the endpoint's dialect
        (``protocol.render_error``); a stream that fails later ends with the dialect's error event
        (``protocol.stream_error``) and still sends its ``Trailer``. Closing the iterator early
        (the client went away) aborts the request in the engine.
        """
        ...

    async def check_health(self) -> None:
        """Return if the backend can serve; raise a plain ``RuntimeError`` if it cannot (Ray
        Serve then replaces the replica). Never an exception that holds the engine's state."""

    def diagnostics(self) -> Diagnostics:
        """The backend's current ``Diagnostics``; cheap, never raises."""
        ...

    def shutdown(self) -> None:
        """Stop the engine and whatever watches it; safe to call twice and before ``start``."""
