"""serve_app.gateway.forward: relaying a model's head + SSE chunks, exiting the request's pass
with the engine's token counts (a stream's when its response ends), and mapping handle failures.

The model's ``ModelClient`` is faked (``tests.unit.fakes.FakeClient``): ``call(endpoint, body, ctx)``
returns an object with ``__anext__`` and ``cancel()``, like ``routing.direct.DirectCall`` (whose
transport failures are ``ConnectionError``s). The forwarder's ``Answer`` is checked as the HTTP
layer serves it (``http.answers.to_response``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine
from typing import Any

import pytest
from starlette.responses import Response, StreamingResponse

from serve_app import errors
from serve_app.config import HttpConfig
from serve_app.gateway.accounting.timing import StageClock
from serve_app.gateway.admission.ledger import Outcome
from serve_app.gateway.forward import Forwarder
from serve_app.gateway.http.answers import to_response
from serve_app.gateway.routing.direct import Broken
from serve_app.protocol import (
    ENDPOINTS,
    SSE_DONE,
    RequestContext,
    head,
    split_complete,
    tokens_of,
    trailer,
)
from tests.unit.fakes import HANG, FakeClient, FakeStream

CTX = RequestContext(request_id="r1", key_id="k1", tier="standard", priority=3, deadline=0.0)
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


class FakePass:
    """Records how the forwarder exits the request's pass."""

    model_id = "tiny-chat"

    def __init__(self) -> None:
        self.outcomes: list[Outcome] = []
        self.clock = StageClock(time.time())

    async def exit(self, out: Outcome) -> None:
        self.outcomes.append(out)


def _forwarder(gen: FakeStream, **http: Any) -> tuple[Forwarder, FakeClient]:
    handle = FakeClient(gen)
    cfg = HttpConfig(**{"retry_after_s": 7, **http})
    return Forwarder({"tiny-chat": handle}, cfg), handle


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


async def _forward(fwd: Forwarder, endpoint: str = "chat", ledger: Any = None) -> Response:
    return to_response(await fwd.forward(ledger or FakePass(), ENDPOINTS[endpoint], BODY, CTX,
                                         {"x-request-id": "abc"}))


async def _body(resp: StreamingResponse) -> bytes:
    return b"".join([c async for c in resp.body_iterator])  # type: ignore[misc]


async def _serve(resp: Response, disconnect_after: int | None = None) -> list[bytes]:
    """Send ``resp`` as Starlette does (ASGI 2.0: it listens for a disconnect meanwhile); the
    client goes away after ``disconnect_after`` body chunks (0: before the first), or never."""
    sent: list[bytes] = []
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if disconnect_after is None:
            await asyncio.Event().wait()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            sent.append(message["body"])
        if disconnect_after is not None and len(sent) >= disconnect_after:
            gone.set()
            await asyncio.sleep(0.01)  # the server notices before it sends more

    await resp({"type": "http"}, receive, send)
    return sent


# ---- before the first byte ---------------------------------------------------------------------
def test_calls_the_named_method_with_plain_context() -> None:
    fwd, handle = _forwarder(FakeStream([head(200, b"{}")]))
    _run(_forward(fwd, "embeddings"))
    ((_, method, body, ctx),) = handle.calls
    assert method == "embeddings"
    assert body == BODY
    assert ctx == CTX.to_dict()
    assert json.loads(json.dumps(ctx)) == ctx  # JSON-serialisable, nothing else crosses


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionRefusedError("/secret/path.py"),
        Broken("model 'tiny-chat': the connection to replica r1 broke (IncompleteReadError)"),
    ],
    ids=["refused", "broken-before-head"],
)
def test_unavailable_model_is_503(exc: Exception) -> None:
    fwd, _ = _forwarder(FakeStream([exc]))
    with pytest.raises(errors.ServiceUnavailable) as exc_info:
        _run(_forward(fwd))
    assert exc_info.value.headers["Retry-After"] == "7"
    assert "/secret/path.py" not in exc_info.value.message


def test_no_answer_is_500() -> None:
    fwd, _ = _forwarder(FakeStream([]))
    with pytest.raises(errors.InternalError) as exc_info:
        _run(_forward(fwd))
    assert exc_info.value.status == 500


def test_no_first_byte_within_request_timeout_is_504_and_cancels() -> None:
    gen = FakeStream([HANG])
    fwd, _ = _forwarder(gen, request_timeout_s=0.05)
    with pytest.raises(errors.GatewayTimeout) as exc_info:
        _run(_forward(fwd))
    assert exc_info.value.status == 504
    assert gen.cancelled


# ---- complete answers --------------------------------------------------------------------------
def test_non_stream_head_becomes_plain_response() -> None:
    gen = FakeStream([head(400, b'{"error": {"message": "bad"}}'), b"unexpected"])
    fwd, _ = _forwarder(gen)
    resp = _run(_forward(fwd))
    assert not isinstance(resp, StreamingResponse)
    assert resp.status_code == 400
    assert resp.body == b'{"error": {"message": "bad"}}'
    assert resp.media_type == "application/json"
    assert resp.headers["x-request-id"] == "abc"
    assert gen.cancelled  # the model's stream is released at once


# ---- streams -----------------------------------------------------------------------------------
def test_stream_relays_first_bytes_then_chunks() -> None:
    gen = FakeStream([head(200, b"data: 1\n\n", stream=True), (b"data: 2\n\n", 2),
                   (b"data: 3\n\n" + SSE_DONE, 3)])
    fwd, _ = _forwarder(gen)

    async def scenario() -> tuple[StreamingResponse, bytes]:
        resp = await _forward(fwd)
        assert isinstance(resp, StreamingResponse)
        return resp, await _body(resp)

    resp, body = _run(scenario())
    assert body == b"data: 1\n\ndata: 2\n\ndata: 3\n\n" + SSE_DONE
    assert resp.status_code == 200
    assert resp.media_type == "text/event-stream"
    assert resp.headers["x-request-id"] == "abc"
    assert resp.headers["cache-control"] == "no-cache"
    assert not gen.cancelled  # it finished by itself


def test_stream_trailer_is_not_relayed() -> None:
    gen = FakeStream([head(200, b"data: 1\n\n", stream=True), (b"data: 2\n\n", 4), trailer(3, 4)])
    fwd, _ = _forwarder(gen)

    async def scenario() -> bytes:
        return await _body(await _forward(fwd))

    assert _run(scenario()) == b"data: 1\n\ndata: 2\n\n"


def _events(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e]


def test_error_mid_stream_ends_with_error_event_and_done() -> None:
    gen = FakeStream([head(200, b"data: 1\n\n", stream=True), (b"data: 2\n\n", 2), ConnectionResetError()])
    fwd, _ = _forwarder(gen)

    async def scenario() -> bytes:
        return await _body(await _forward(fwd))

    body = _run(scenario())
    assert body.startswith(b"data: 1\n\ndata: 2\n\n")
    assert body.endswith(SSE_DONE)
    events = _events(body)
    assert events[-1] == b"data: [DONE]"
    err = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "service_unavailable"


def test_stream_idle_timeout_ends_with_timeout_event() -> None:
    gen = FakeStream([head(200, b"data: 1\n\n", stream=True), HANG])
    fwd, _ = _forwarder(gen, stream_idle_timeout_s=0.05)

    async def scenario() -> bytes:
        return await _body(await _forward(fwd))

    body = _run(scenario())
    events = _events(body)
    assert events[0] == b"data: 1"
    assert events[-1] == b"data: [DONE]"
    assert json.loads(events[-2].removeprefix(b"data: "))["error"]["code"] == "timeout"


def test_stream_idle_timeout_cancels_the_model_request() -> None:
    gen = FakeStream([head(200, b"data: 1\n\n", stream=True), HANG])
    fwd, _ = _forwarder(gen, stream_idle_timeout_s=0.05)

    async def scenario() -> bytes:
        return await _body(await _forward(fwd))

    _run(scenario())
    assert gen.cancelled


def test_client_disconnect_cancels_the_model_request() -> None:
    gen = FakeStream([head(200, b"data: 1\n\n", stream=True), (b"data: 2\n\n", 2), HANG])
    fwd, _ = _forwarder(gen)

    async def scenario() -> list[bytes]:
        return await _serve(await _forward(fwd), disconnect_after=1)

    assert _run(scenario()) == [b"data: 1\n\n"]
    assert gen.cancelled



# ---- the ledger is closed once, with the engine's counts ----------------------------------------
def test_complete_answer_closes_the_ledger_with_its_usage() -> None:
    ledger = FakePass()
    fwd, _ = _forwarder(FakeStream([head(200, b"{}", tokens=tokens_of(5, 7))]))
    _run(_forward(fwd, ledger=ledger))
    assert [o.tokens for o in ledger.outcomes] == [tokens_of(5, 7)]
    assert ledger.outcomes[0].used_tokens == 12


def test_error_head_closes_the_ledger_with_no_tokens_used() -> None:
    ledger = FakePass()
    fwd, _ = _forwarder(FakeStream([head(400, b'{"error": {}}')]))
    _run(_forward(fwd, ledger=ledger))
    assert [(o.status, o.used_tokens) for o in ledger.outcomes] == [(400, 0)]


def test_no_answer_leaves_the_ledger_to_the_caller() -> None:
    ledger = FakePass()
    fwd, _ = _forwarder(FakeStream([ConnectionRefusedError()]))
    with pytest.raises(errors.ServiceUnavailable):
        _run(_forward(fwd, ledger=ledger))
    assert ledger.outcomes == []


def test_finished_stream_is_charged_the_trailer_counts() -> None:
    ledger = FakePass()
    gen = FakeStream([head(200, b"data: 1\n\n", stream=True, tokens=tokens_of(3, 1)),
                   (b"data: 2\n\n", 9), trailer(3, 10)])
    fwd, _ = _forwarder(gen)

    async def scenario() -> None:
        await _serve(await _forward(fwd, ledger=ledger))

    _run(scenario())
    assert [o.tokens for o in ledger.outcomes] == [tokens_of(3, 10)]


def test_a_streams_books_are_written_before_its_last_events_go_out() -> None:
    """The trailer comes before the bytes with the answer's last events (usage, [DONE]); the books
    are closed there, so a gateway that dies once the client has its [DONE] has counted it; the
    stream's end does not close them a second time."""
    ledger = FakePass()
    gen = FakeStream([head(200, b"data: 1\n\n", stream=True, tokens=tokens_of(3, 1)),
                      (b"data: 2\n\n", 9), trailer(3, 10), (b"data: [DONE]\n\n", 10)])
    fwd, _ = _forwarder(gen)

    async def scenario() -> list[tuple[bytes, int]]:
        resp = await _forward(fwd, ledger=ledger)
        return [(c, len(ledger.outcomes)) async for c in resp.body_iterator]  # type: ignore[misc]

    seen = _run(scenario())
    assert seen == [(b"data: 1\n\n", 0), (b"data: 2\n\n", 0), (b"data: [DONE]\n\n", 1)]
    assert [o.tokens for o in ledger.outcomes] == [tokens_of(3, 10)]


def test_stream_cut_short_is_charged_the_engines_count_not_events() -> None:
    """Pacing merges several tokens into one event: the last chunk's count is what the engine made
    (here 12 tokens in 2 events), where counting events would charge 2."""
    ledger = FakePass()
    gen = FakeStream([head(200, b"data: 1\n\n", stream=True, tokens=tokens_of(40, 5)),
                   (b"data: 2\n\n", 12), HANG])
    fwd, _ = _forwarder(gen)

    async def scenario() -> list[bytes]:
        return await _serve(await _forward(fwd, ledger=ledger), disconnect_after=2)

    assert _run(scenario()) == [b"data: 1\n\n", b"data: 2\n\n"]
    assert gen.cancelled
    assert [o.tokens for o in ledger.outcomes] == [tokens_of(40, 12)]


def test_a_client_gone_before_the_first_chunk_still_ends_the_request() -> None:
    """Starlette never starts the body iterator then; the response's own ``__call__`` still
    cancels the model's stream and closes the ledger, once."""
    ledger = FakePass()
    gen = FakeStream([head(200, b"data: 1\n\n", stream=True, tokens=tokens_of(8, 0)), HANG])
    fwd, _ = _forwarder(gen)

    async def scenario() -> list[bytes]:
        return await _serve(await _forward(fwd, ledger=ledger), disconnect_after=0)

    assert _run(scenario()) == []
    assert gen.cancelled
    assert [o.tokens for o in ledger.outcomes] == [tokens_of(8, 0)]
    assert not fwd.drain.active


# ---- a complete answer larger than one message arrives in parts ----------------------------------
def test_complete_answer_in_parts_is_joined_whole() -> None:
    body = json.dumps({"data": ["x" * 1000] * 300}).encode()
    gen = FakeStream(split_complete(200, body, tokens_of(3, 0), part_bytes=4096))
    assert len(gen.items) > 2 and all(len(i) <= 4096 for i in gen.items[1:])
    ledger = FakePass()
    fwd, _ = _forwarder(gen)
    resp = _run(_forward(fwd, "embeddings", ledger=ledger))
    assert resp.body == body and resp.status_code == 200
    assert [o.tokens for o in ledger.outcomes] == [tokens_of(3, 0)]
    assert gen.cancelled


def test_answer_cut_between_its_parts_is_an_error_not_a_truncated_200() -> None:
    """The model ran: the break is ``AnswerBroken`` (502), not the 503 "nothing ran" that the
    pipeline would fall back on or book as backpressure."""
    items = split_complete(200, b"x" * 10000, None, part_bytes=4096)
    gen = FakeStream([items[0], items[1], ConnectionResetError()])
    ledger = FakePass()
    fwd, _ = _forwarder(gen)
    with pytest.raises(errors.AnswerBroken) as exc_info:
        _run(_forward(fwd, ledger=ledger))
    assert not isinstance(exc_info.value, errors.ServiceUnavailable)
    assert exc_info.value.status == 502
    assert gen.cancelled
    assert ledger.outcomes == []  # the pipeline closes it


# ---- a model whose replicas are gone -----------------------------------------------------------
def test_a_request_held_for_a_lost_replica_is_answered_503_once_none_runs() -> None:
    from serve_app.gateway.outage import OutageGuard
    from serve_app.gateway.routing.replicas import LiveReplicas, Status

    counts = {"tiny-chat": 1}
    live = LiveReplicas(lambda: Status(dict(counts)), 0.1)
    live.refresh()
    gen = FakeStream([HANG])
    cfg = HttpConfig(retry_after_s=7, unavailable_hold_s=0.5)
    fwd = Forwarder({"tiny-chat": FakeClient(gen)}, cfg,
                    OutageGuard(cfg.unavailable_hold_s, live))

    async def run() -> None:
        task = asyncio.create_task(_forward(fwd))
        await asyncio.sleep(1.0)
        assert not task.done()  # a running replica: the request waits for its answer
        counts["tiny-chat"] = 0  # the node is lost and the controller counts no replica
        live.refresh()
        with pytest.raises(errors.ServiceUnavailable) as exc_info:
            await asyncio.wait_for(task, 3)
        assert exc_info.value.headers["Retry-After"] == "7"

    _run(run())
    assert gen.cancelled


def test_a_streams_time_to_first_token_ends_when_its_first_bytes_are_written() -> None:
    """The TTFT is the client's: it ends once the server has taken the first body bytes for the
    client's connection (a slow write counts), not when the gateway got them from the model."""
    ledger = FakePass()
    gen = FakeStream([head(200, b"data: 1\n\n", stream=True, tokens=tokens_of(3, 1)),
                      (b"data: 2\n\n", 2), trailer(3, 2)])
    fwd, _ = _forwarder(gen)
    write_s = 0.2

    async def scenario() -> float:
        resp = await _forward(fwd, ledger=ledger)
        started = time.time()

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()
            return {}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                await asyncio.sleep(write_s)  # the client's connection takes its time

        await resp({"type": "http"}, receive, send)
        return started - ledger.clock.arrival

    before = _run(scenario())
    (out,) = ledger.outcomes
    assert out.ttft_s is not None and out.ttft_s >= before + write_s


def test_a_stream_read_by_the_batch_runner_has_a_ttft_too() -> None:
    ledger = FakePass()
    gen = FakeStream([head(200, b"data: 1\n\n", stream=True, tokens=tokens_of(3, 1)),
                      trailer(3, 1)])
    fwd, _ = _forwarder(gen)

    async def scenario() -> bytes:
        answer = await fwd.forward(ledger, ENDPOINTS["chat"], BODY, CTX, {})
        return await answer.read()

    assert _run(scenario()) == b"data: 1\n\n"
    assert ledger.outcomes[0].ttft_s is not None
