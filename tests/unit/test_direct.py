"""The gateway's stream to a model replica (serve_app.wire, engine.endpoint, gateway.routing.direct).

Real sockets on loopback, no Ray: a ``ModelEndpoint`` over a stand-in for ``ModelService.handle``,
and the gateway's ``DirectClient`` choosing among such endpoints. Each defence is checked by what
the replica's handler saw: a request with a wrong token never reaches it, a hang-up cancels it, a
draining replica hands the request to another before anything runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from serve_app import wire
from serve_app.engine.endpoint import ModelEndpoint
from serve_app.gateway.routing.direct import Broken, DirectClient
from serve_app.gateway.routing.placement import Picker
from serve_app.protocol import head, split_complete, trailer

TOKEN = "t0ken"
CTX = {"request_id": "r1", "key_id": "k", "tier": "premium", "affinity": "tenant/session"}


class Model:
    """Stands in for ``ModelService.handle``: records each call, answers with ``items`` (and waits
    at ``None``), and notes when its answer was closed (cancelled or done)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.calls: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
        self.closed = asyncio.Event()
        self.cancelled = False

    async def handle(self, endpoint: str, body: dict[str, Any], ctx: dict[str, Any]) -> AsyncIterator[Any]:
        self.calls.append((endpoint, body, ctx))
        try:
            for item in self.items:
                if item is None:
                    await asyncio.Event().wait()
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled = True
            raise
        finally:
            self.closed.set()


async def _endpoint(model: Model, token: str = TOKEN, max_ongoing: int = 64) -> ModelEndpoint:
    ep = ModelEndpoint(model.handle, lambda: token, "127.0.0.1", max_ongoing)
    await ep.start()
    return ep


def _client(table: dict[str, tuple[str, int]], affinity: bool = True) -> DirectClient:
    return DirectClient("m", lambda: table, lambda: TOKEN, Picker(affinity))


async def _read_all(call: Any) -> list[Any]:
    items = []
    while True:
        try:
            items.append(await call.__anext__())
        except StopAsyncIteration:
            return items


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


STREAM = [head(200, b"data: 1\n\n", stream=True), (b"data: 2\n\n", 2), trailer(5, 3),
          (b"data: [DONE]\n\n", 3)]


def test_frames_carry_every_item_of_an_answer() -> None:
    async def parse(data: bytes) -> list[Any]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        out = []
        while not reader.at_eof():
            out.append(wire.decode(*await wire.read_frame(reader)))
        return out

    items = [*split_complete(200, b"x" * 10, None, part_bytes=4), (b"", 0), trailer(1, 2)]
    decoded = asyncio.run(parse(b"".join(wire.item(i, load=7) for i in items)))
    assert decoded[0] == {**items[0], "load": 7}
    assert decoded[1:] == items[1:]


def test_a_stream_arrives_whole_and_the_picker_counts_it_while_it_runs() -> None:
    async def scenario() -> None:
        model = Model(STREAM)
        ep = await _endpoint(model)
        client = _client({"r1": ("127.0.0.1", ep.port)})
        call = client.call("chat", {"model": "m"}, CTX)
        first = await call.__anext__()
        assert first["status"] == 200 and first["body"] == b"data: 1\n\n"
        assert client.picker.in_flight == {"r1": 1} and client.picker.reported == {"r1": 1}
        assert await _read_all(call) == STREAM[1:]
        assert client.picker.in_flight == {}
        assert model.calls == [("chat", {"model": "m"}, CTX)]
        await asyncio.wait_for(model.closed.wait(), 2)
        assert ep.in_flight == 0 and not model.cancelled
        ep.close()

    _run(scenario())


def test_hanging_up_cancels_the_request_in_the_replica() -> None:
    async def scenario() -> None:
        model = Model([head(200, b"data: 1\n\n", stream=True), None])
        ep = await _endpoint(model)
        client = _client({"r1": ("127.0.0.1", ep.port)})
        call = client.call("chat", {}, CTX)
        await call.__anext__()
        assert ep.in_flight == 1
        call.cancel()  # the client went away
        await asyncio.wait_for(model.closed.wait(), 2)
        assert model.cancelled and ep.in_flight == 0
        ep.close()

    _run(scenario())


def test_a_wrong_token_never_reaches_the_model() -> None:
    async def scenario() -> None:
        model = Model(STREAM)
        ep = await _endpoint(model, token="another")
        reader, writer = await asyncio.open_connection("127.0.0.1", ep.port)
        writer.write(wire.request(TOKEN, "chat", {}, CTX))
        kind, payload = await wire.read_frame(reader)
        assert kind == wire.REFUSED and b"token" in payload
        writer.close()
        # The right token on a request of the wrong shape: refused too, never a traceback.
        ep2 = await _endpoint(model)
        reader, writer = await asyncio.open_connection("127.0.0.1", ep2.port)
        writer.write(wire.frame(wire.REQUEST, b'{"token": "t0ken", "endpoint": 3, "body": []}'))
        kind, payload = await wire.read_frame(reader)
        assert kind == wire.REFUSED and b"request" in payload
        assert model.calls == []
        writer.close()
        ep.close()
        ep2.close()

    _run(scenario())


def test_garbage_on_the_port_is_dropped_without_reaching_the_model() -> None:
    async def scenario() -> None:
        model = Model(STREAM)
        ep = await _endpoint(model)
        for junk in (b"GET / HTTP/1.1\r\n\r\n", wire.frame(wire.REQUEST, b"{not json"),
                     wire.frame(wire.HEAD, b"{}")):
            reader, writer = await asyncio.open_connection("127.0.0.1", ep.port)
            writer.write(junk)
            assert await reader.read() == b""  # closed, no answer
            writer.close()
        assert model.calls == [] and ep.in_flight == 0
        ep.close()

    _run(scenario())


def test_a_draining_replica_hands_the_request_to_another_and_lets_its_own_finish() -> None:
    async def scenario() -> None:
        busy = Model([head(200, b"data: 1\n\n", stream=True), None])
        other = Model(STREAM)
        ep_busy, ep_other = await _endpoint(busy), await _endpoint(other)
        table = {"a": ("127.0.0.1", ep_busy.port)}
        client = _client(table, affinity=False)
        running = client.call("chat", {}, CTX)
        await running.__anext__()
        drained = asyncio.create_task(ep_busy.drain(10))
        table["b"] = ("127.0.0.1", ep_other.port)
        client.picker.reported["b"] = 99  # the draining replica looks less loaded: tried first
        late = client.call("chat", {}, CTX)
        assert (await late.__anext__())["status"] == 200
        assert len(busy.calls) == 1 and len(other.calls) == 1  # refused there, served here
        assert not drained.done()  # its own stream still runs
        running.cancel()
        assert await asyncio.wait_for(drained, 5) == 0
        await _read_all(late)
        ep_busy.close()
        ep_other.close()

    _run(scenario())


def test_an_unreachable_replica_is_skipped_and_tried_last_for_a_while() -> None:
    async def scenario() -> None:
        model = Model(STREAM)
        ep = await _endpoint(model)
        dead = await _endpoint(Model([]))
        dead.close()  # registered, but nothing listens any more
        await asyncio.sleep(0.05)
        table = {"dead": ("127.0.0.1", dead.port), "live": ("127.0.0.1", ep.port)}
        failures: list[str] = []
        client = DirectClient("m", lambda: table, lambda: TOKEN, Picker(False),
                              on_failure=failures.append)
        client.picker.reported["live"] = 5  # the dead one looks better
        call = client.call("chat", {}, CTX)
        assert (await call.__anext__())["status"] == 200
        assert failures == ["m"] and "dead" in client.failed
        assert [r for r, _ in client.order("")][-1] == "dead"
        await _read_all(call)
        ep.close()

    _run(scenario())


def test_a_replica_that_dies_between_accept_and_write_is_skipped(monkeypatch) -> None:
    """Under uvloop (Ray Serve's loop), writing to a transport the dead replica closed raises
    RuntimeError: the client got a 500 (CI, test_faults). Nothing was sent: try the next one."""
    import uvloop

    from serve_app.gateway.routing import direct

    async def scenario() -> None:
        model = Model(STREAM)
        ep = await _endpoint(model)
        dying = await _endpoint(Model([]))
        real_open = asyncio.open_connection

        async def open_connection(host: str, port: int, **kw: Any) -> Any:
            reader, writer = await real_open(host, port, **kw)
            if port == dying.port:  # accepted, then closed under the gateway's feet
                writer.transport.abort()
                await asyncio.sleep(0)
            return reader, writer

        monkeypatch.setattr(direct.asyncio, "open_connection", open_connection)
        table = {"dying": ("127.0.0.1", dying.port), "live": ("127.0.0.1", ep.port)}
        failures: list[str] = []
        client = DirectClient("m", lambda: table, lambda: TOKEN, Picker(False),
                              on_failure=failures.append)
        client.picker.reported["live"] = 5  # the dying one looks better
        try:
            call = client.call("chat", {}, CTX)
            assert (await call.__anext__())["status"] == 200
            assert failures == ["m"] and "dying" in client.failed
            await _read_all(call)
            assert client.picker.in_flight == {} and len(model.calls) == 1
        finally:
            ep.close()
            dying.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(asyncio.wait_for(scenario(), 20))


def test_a_cut_connection_mid_stream_is_broken_not_an_end() -> None:
    async def scenario() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await wire.read_frame(reader)
            writer.write(wire.item(STREAM[0], 1) + wire.item(STREAM[1], 1))
            await writer.drain()
            writer.close()  # the replica died: no END

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = _client({"r": ("127.0.0.1", port)})
        call = client.call("chat", {}, CTX)
        await call.__anext__()
        assert await call.__anext__() == STREAM[1]
        with pytest.raises(Broken):
            await call.__anext__()
        assert client.picker.in_flight == {}
        server.close()

    _run(scenario())


def test_a_model_with_no_replica_yet_waits_for_one() -> None:
    async def scenario() -> None:
        model = Model(STREAM)
        ep = await _endpoint(model)
        table: dict[str, tuple[str, int]] = {}
        client = _client(table)
        call = client.call("chat", {}, CTX)
        task = asyncio.create_task(call.__anext__())
        await asyncio.sleep(0.5)
        assert not task.done()
        table["r"] = ("127.0.0.1", ep.port)  # the next refresh brings one
        assert (await asyncio.wait_for(task, 3))["status"] == 200
        await _read_all(call)
        ep.close()

    _run(scenario())


def test_affinity_keeps_a_session_on_one_replica() -> None:
    async def scenario() -> None:
        models = [Model(STREAM), Model(STREAM), Model(STREAM)]
        eps = [await _endpoint(m) for m in models]
        client = _client({f"r{i}": ("127.0.0.1", e.port) for i, e in enumerate(eps)})
        for _ in range(5):
            await _read_all_from(client.call("chat", {}, CTX))
        assert sorted(len(m.calls) for m in models) == [0, 0, 5]
        for e in eps:
            e.close()

    async def _read_all_from(call: Any) -> None:
        await call.__anext__()
        await _read_all(call)

    _run(scenario())



def test_requests_past_max_ongoing_wait_in_arrival_order_and_a_hang_up_leaves_the_queue() -> None:
    """The deployment's max_ongoing_requests: the third request starts only when one of the two
    running ends; one that hangs up while it waits never reaches the model."""
    async def scenario() -> None:
        model = Model([head(200, b"data: 1\n\n", stream=True), None])
        ep = await _endpoint(model, max_ongoing=2)
        client = _client({"r": ("127.0.0.1", ep.port)})
        running = [client.call("chat", {"n": i}, CTX) for i in range(2)]
        for call in running:
            await call.__anext__()
        waiting = client.call("chat", {"n": 2}, CTX)
        gone = client.call("chat", {"n": 3}, CTX)
        third = asyncio.create_task(waiting.__anext__())
        fourth = asyncio.create_task(gone.__anext__())
        await asyncio.sleep(0.3)
        assert not third.done() and ep.in_flight == 4  # taken, waiting for a slot
        assert len(model.calls) == 2
        fourth.cancel()  # its client went away while it waited
        gone.cancel()
        await asyncio.sleep(0.2)
        assert ep.in_flight == 3
        running[0].cancel()  # a slot frees
        assert (await asyncio.wait_for(third, 2))["status"] == 200
        assert [c[1] for c in model.calls] == [{"n": 0}, {"n": 1}, {"n": 2}]
        for call in (running[1], waiting):
            call.cancel()
        ep.close()

    _run(scenario())
