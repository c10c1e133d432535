"""serve_app.engine.local: a model served in the gateway's process, through the ModelClient seam."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from serve_app.engine.local import InProcessClient


class FakeServer:
    """The part of ``ModelService`` the in-gateway path calls."""

    def __init__(self) -> None:
        self.closed = False
        self.bodies: list[dict[str, Any]] = []

    async def handle(self, endpoint: str, body: dict[str, Any], ctx: dict[str, Any]) -> AsyncIterator[Any]:
        self.bodies.append(body)
        body["model"] = "changed by the server"
        try:
            yield {"status": 200, "stream": True, "endpoint": endpoint, "ctx": ctx}
            for i in range(100):
                yield f"chunk {i}".encode()
                await asyncio.sleep(0)
        finally:
            self.closed = True

    async def check_health(self) -> None:
        raise RuntimeError("engine core died")

    def stats(self) -> dict[str, Any]:
        return {"model": "m", "running": 1}

    def shutdown(self) -> None:
        self.closed = True


def test_a_call_streams_the_services_answer_and_cancel_aborts_it() -> None:
    server = FakeServer()
    local = InProcessClient(server)

    async def go() -> tuple[Any, bytes, bool]:
        body = {"model": "m", "stream": True}
        gen = local.call("chat", body, {"request_id": "r"})
        assert local.transport == "in process" and body["model"] == "m"  # the caller's body is kept
        head = await gen.__anext__()
        chunk = await gen.__anext__()
        gen.cancel()
        gen.cancel()  # a second cancel does nothing
        for _ in range(5):
            await asyncio.sleep(0)
        return head, chunk, server.closed

    head, chunk, closed = asyncio.run(go())
    assert head["status"] == 200 and head["ctx"] == {"request_id": "r"} and chunk == b"chunk 0"
    assert closed  # the engine request is aborted when the generator closes


def test_health_and_stats_are_the_servers() -> None:
    local = InProcessClient(FakeServer())
    assert asyncio.run(local.stats()) == {"model": "m", "running": 1}
    with pytest.raises(RuntimeError, match="engine core died"):  # Ray Serve replaces the replica
        asyncio.run(local.check_health())
