"""``protocol.ModelClient`` straight to a model replica's own endpoint (``serve_app.wire``).

The gateway picks the replica itself (``placement.Picker``: affinity and load), opens one
connection to that replica's endpoint (``replicas.LiveReplicas.endpoints``), sends the request and
reads the answer's frames as the ``protocol`` items the forwarder expects. Nothing crosses a Ray
Serve handle: the tokens travel one TCP hop, with no Ray object, no second event loop and no Ray
Serve replica wrapper on the way.

Before anything ran, a replica that cannot be reached, or that refuses (it is draining, or it
holds another token), is skipped for the next in the placement's order; when none takes the
request it waits for the next refresh of the table and tries again, as Ray Serve's router held a
request while a model had no replica. How long is bounded above this module: the outage guard's
hold and the request timeout (``gateway.outage``, ``gateway.forward``). A connection cut after the
request went out raises ``ConnectionError`` (before the head: the forwarder answers 503; after it:
a stream error event). ``cancel`` closes the connection, which cancels the request in the replica
(vLLM aborts it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from serve_app import wire
from serve_app.gateway.routing.placement import Decision, Picker

logger = logging.getLogger("ray.serve")

CONNECT_TIMEOUT_S = 5.0
RETRY_S = 0.25  # between rounds over every replica, while none takes the request
FAILED_FOR_S = 2.0  # a replica that could not be reached is tried last for this long

Address = tuple[str, int]


class Broken(ConnectionError):
    """The connection to the replica broke before the answer's end."""


class DirectClient:
    """Calls one model's replicas through their endpoints."""

    transport = "direct"

    def __init__(self, model_id: str, endpoints: Callable[[], Mapping[str, Address]],
                 token: Callable[[], str], picker: Picker,
                 on_decision: Callable[[Decision], None] | None = None,
                 on_failure: Callable[[str], None] | None = None,
                 on_empty: Callable[[], None] | None = None) -> None:
        self.model_id = model_id
        self.endpoints = endpoints
        self.token = token
        self.picker = picker
        self.on_decision = on_decision
        self.on_failure = on_failure
        self.on_empty = on_empty  # no replica took the request: ask for a fresh table
        self.failed: dict[str, float] = {}  # replica id -> when it last could not be reached

    def call(self, endpoint: str, body: dict[str, Any], ctx: dict[str, Any]) -> DirectCall:
        return DirectCall(self, endpoint, body, ctx)

    def order(self, key: str) -> list[tuple[str, Address]]:
        """The replicas to try, in order: the placement's, with the recently unreachable last."""
        table = self.endpoints()
        if not table:
            return []
        self.picker.keep_only(list(table))
        placement = self.picker.choose(key, list(table))
        if self.on_decision is not None:
            self.on_decision(placement.decision)
        if self.failed:  # only the recent failures are kept: a replica that left is forgotten
            now = time.monotonic()
            self.failed = {r: t for r, t in self.failed.items() if now - t < FAILED_FOR_S}
        order = [r for r in placement.order if r not in self.failed] + \
                [r for r in placement.order if r in self.failed]
        return [(r, table[r]) for r in order]


class DirectCall:
    """One request's answer (``protocol.ModelCall``): the head from ``__anext__``'s first call,
    then the answer's items; ``cancel`` hangs up."""

    def __init__(self, client: DirectClient, endpoint: str, body: dict[str, Any],
                 ctx: dict[str, Any]) -> None:
        self._client = client
        self._endpoint = endpoint
        self._body = body
        self._ctx = ctx
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._replica: str | None = None  # counted in the picker's in-flight while set
        self._ended = False

    def __anext__(self) -> Any:
        if self._reader is None:
            return self._open()
        return self._next()

    async def _open(self) -> Any:
        """Send the request to the first replica that takes it; return the head."""
        client = self._client
        key = self._ctx.get("affinity") or ""
        try:
            while True:
                # Made again each round: a refresh may bring a new token (a new registry).
                payload = wire.request(client.token(), self._endpoint, self._body, self._ctx)
                for replica, (host, port) in client.order(key):
                    head = await self._try(replica, host, port, payload)
                    if head is not None:
                        return head
                if client.on_empty is not None:
                    client.on_empty()
                await asyncio.sleep(RETRY_S)
        except BaseException:
            self.cancel()
            raise

    async def _try(self, replica: str, host: str, port: int, payload: bytes) -> Any:
        """The head from ``replica``, or None if it did not take the request (nothing ran)."""
        client = self._client
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=wire.MAX_FRAME_BYTES), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            return self._unreached(replica, host, port, exc)
        self._reader, self._writer, self._replica = reader, writer, replica
        client.picker.sent(replica)
        try:
            writer.write(payload)
        except (OSError, RuntimeError) as exc:
            # The replica died between accept and write: uvloop raises RuntimeError ("the handler
            # is closed") on a closed transport. Nothing was sent, so nothing ran: try another.
            self._hang_up()
            self._reader = None
            return self._unreached(replica, host, port, exc)
        kind, data = await self._frame()
        if kind == wire.REFUSED:
            self._hang_up()
            self._reader = None
            return None
        item = wire.decode(kind, data)
        if kind == wire.HEAD:
            client.picker.report(replica, int(item.pop("load", 0)))
            client.failed.pop(replica, None)
        return item

    def _unreached(self, replica: str, host: str, port: int, exc: BaseException) -> None:
        client = self._client
        logger.warning("model %s replica %s not reached at %s:%d: %s", client.model_id,
                       replica, host, port, exc.__class__.__name__)
        client.failed[replica] = time.monotonic()
        if client.on_failure is not None:
            client.on_failure(client.model_id)

    async def _next(self) -> Any:
        if self._ended:
            raise StopAsyncIteration
        kind, data = await self._frame()
        if kind == wire.END:
            self._ended = True
            self._hang_up()
            raise StopAsyncIteration
        return wire.decode(kind, data)

    async def _frame(self) -> tuple[bytes, bytes]:
        assert self._reader is not None
        try:
            return await wire.read_frame(self._reader)
        except (asyncio.IncompleteReadError, ConnectionError, wire.WireError) as exc:
            self._hang_up()
            if self._client.on_failure is not None:
                self._client.on_failure(self._client.model_id)
            raise Broken(f"model {self._client.model_id!r}: the connection to replica "
                         f"{self._replica} broke ({exc.__class__.__name__})") from None

    def cancel(self) -> None:
        """Hang up (the replica cancels the request); safe to call more than once."""
        self._ended = True
        self._hang_up()

    def _hang_up(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._replica is not None:
            self._client.picker.done(self._replica)
            self._replica = None
