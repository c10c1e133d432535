"""A model replica's own port (serve_app.engine.endpoint) answers only the application's gateways.

Reaching the port must not skip the gateway's keys and limits: a request without the app's token
(or with another) is refused before the model sees it, and bytes that are not a request frame get
no answer at all. Real sockets on loopback, no Ray."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from serve_app import wire
from serve_app.engine.endpoint import ModelEndpoint
from serve_app.protocol import head

CTX = {"request_id": "r", "key_id": "k", "tier": "premium"}


def test_no_token_no_answer() -> None:
    calls: list[str] = []

    async def handle(endpoint: str, body: dict[str, Any], ctx: dict[str, Any]) -> AsyncIterator[Any]:
        calls.append(endpoint)
        yield head(200, b"{}")

    async def scenario() -> list[bytes]:
        ep = ModelEndpoint(handle, lambda: "the-token", "127.0.0.1", 4)
        await ep.start()
        kinds = []
        for frame in (wire.request("", "chat", {}, CTX), wire.request("guess", "chat", {}, CTX),
                      b"POST /v1/chat/completions HTTP/1.1\r\n\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", ep.port)
            writer.write(frame)
            data = await reader.read()
            kinds.append(data[:1])
            writer.close()
        ep.close()
        return kinds

    kinds = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert kinds == [wire.REFUSED, wire.REFUSED, b""]
    assert calls == []  # the model never saw any of them
