"""serve_app.protocol: token counts under every API's names, and errors in each endpoint's own
format (body and mid-stream event); serve_app.engine.adapter's request overrides."""

from __future__ import annotations

import json

from pydantic import BaseModel

from serve_app import errors
from serve_app.engine.adapter import Overrides, handler_for
from serve_app.engine.coalesce import to_sse
from serve_app.protocol import ENDPOINTS, SSE_DONE, render_error, stream_error, usage_tokens


def test_usage_tokens_reads_every_api() -> None:
    assert usage_tokens({"prompt_tokens": 3, "completion_tokens": 4}) == {
        "prompt_tokens": 3, "completion_tokens": 4}
    assert usage_tokens({"input_tokens": 5, "output_tokens": 6, "total_tokens": 11}) == {
        "prompt_tokens": 5, "completion_tokens": 6}
    assert usage_tokens(None) is None


def test_render_error_by_dialect() -> None:
    exc = errors.RateLimited("slow down", headers={"Retry-After": "2"})
    status, body, headers = render_error(ENDPOINTS["chat"], exc)
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded" and headers["Retry-After"] == "2"
    status, body, _ = render_error(ENDPOINTS["messages"], errors.Shed("busy"))
    assert status == 529 and body == {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}


def test_stream_errors_in_each_format() -> None:
    exc = errors.ServiceUnavailable("model gone")
    chat = stream_error(ENDPOINTS["chat"], exc)
    assert chat.endswith(SSE_DONE) and json.loads(chat.split(b"\n")[0][6:])["error"]["message"] == "model gone"
    msg = stream_error(ENDPOINTS["messages"], exc).decode()
    assert msg.startswith("event: error\ndata: ") and "overloaded_error" in msg
    resp = stream_error(ENDPOINTS["responses"], exc).decode()
    event, data = resp.strip().split("\n")
    assert event == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error", "code": "service_unavailable", "message": "model gone", "param": None}


class _Chat(BaseModel):
    priority: int = 0
    request_id: str = "x"
    cache_salt: str | None = None


class _Anthropic(BaseModel):
    cache_salt: str | None = None


def test_overrides_set_only_the_fields_a_request_has() -> None:
    o = Overrides(priority=5, request_id="req-1", cache_salt="salt")
    chat = _Chat(priority=-100, request_id="client", cache_salt="theirs")
    o.apply(chat)
    assert (chat.priority, chat.request_id, chat.cache_salt) == (5, "req-1", "salt")
    msg = _Anthropic()
    o.apply(msg)
    assert msg.cache_salt == "salt" and not hasattr(msg, "priority")
    fifo = _Chat(priority=7)
    Overrides(priority=None, request_id="r", cache_salt=None).apply(fifo)
    assert fifo.priority == 7  # no priority under the FCFS scheduler (vLLM refuses one)


def test_responses_events_becometo_sse() -> None:
    class Event(BaseModel):
        type: str = "response.created"
        sequence_number: int = 0

    assert to_sse(Event()) == 'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'
    assert to_sse("data: [DONE]\n\n") == "data: [DONE]\n\n"


def test_messages_conversion_gets_the_gateways_priority_and_id() -> None:
    """vLLM's Anthropic serving converts each Messages request into a chat request that keeps
    neither priority nor request id; the handler bound for the request applies them to the
    converted one, and leaves vLLM's serving object as it was."""
    import asyncio

    class FakeAnthropicServing:
        async def create_chat_completion(self, request: _Chat, raw_request: object = None) -> _Chat:
            return request

        async def create_messages(self, request: object, raw_request: object = None) -> _Chat:
            converted = self.to_chat_completion_request(request)
            return await self.create_chat_completion(converted, raw_request)

        def to_chat_completion_request(self, request: object) -> _Chat:
            return _Chat()  # what the conversion builds: defaults only

    serving = FakeAnthropicServing()
    call = handler_for(serving, "create_messages", Overrides(priority=10, request_id="req-9", cache_salt="s"))
    chat = asyncio.run(call(object()))
    assert (chat.priority, chat.request_id, chat.cache_salt) == (10, "req-9", "s")
    untouched = asyncio.run(serving.create_messages(object()))  # vLLM's own object: defaults
    assert (untouched.priority, untouched.request_id) == (0, "x")


def test_a_complete_answer_is_split_into_parts_that_fit_one_message() -> None:
    from serve_app.protocol import PART_BYTES, split_complete, tokens_of

    small = split_complete(200, b"{}", tokens_of(1, 2))
    assert small == [{"status": 200, "stream": False, "body": b"{}", "tokens": tokens_of(1, 2), "parts": 0}]
    body = bytes(range(256)) * (3 * PART_BYTES // 256 + 7)
    first, *rest = split_complete(200, body)
    assert isinstance(first, dict) and first["parts"] == len(rest) == 3
    assert all(isinstance(p, bytes) and len(p) <= PART_BYTES for p in rest)
    assert first["body"] + b"".join(rest) == body  # type: ignore[operator]
