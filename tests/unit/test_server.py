"""serve_app.engine's vLLM backend: engine kwargs, error mapping (adapter.py), the SSE coalescer
(coalesce.py) and ``EngineServer.handle`` (no engine started)."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from serve_app import errors
from serve_app.config import EngineArgs, load_app_config
from serve_app.engine.adapter import to_openai_error, validation_error
from serve_app.engine.clients import TokenMeter, current_meter
from serve_app.engine.coalesce import Coalescer
from serve_app.engine.server import EngineServer
from serve_app.protocol import SSE_DONE
from tests.unit.builders import model

CONFIG_FILES = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.y*ml"))


# ---- engine_kwargs -----------------------------------------------------------------------------
def test_engine_kwargs_names_the_model_and_path() -> None:
    kw = model(id="tiny-chat", engine={"max_num_seqs": 8}).engine_kwargs("/models/tiny")
    assert kw["model"] == "/models/tiny"
    assert kw["served_model_name"] == ["tiny-chat"]
    assert kw["max_num_seqs"] == 8
    assert "runner" not in kw
    assert "extra" not in kw


def test_engine_kwargs_drops_unset_optionals_but_keeps_seed_zero() -> None:
    kw = model().engine_kwargs("/m")
    assert "max_model_len" not in kw and "quantization" not in kw
    assert kw["seed"] == 0


def test_engine_kwargs_embed_uses_pooling_runner() -> None:
    assert model(task="embed").engine_kwargs("/m")["runner"] == "pooling"


def test_engine_kwargs_tp_on_cpu_uses_mp() -> None:
    kw = model(engine={"tensor_parallel_size": 2}).engine_kwargs("/m")
    assert kw["distributed_executor_backend"] == "mp"


def test_engine_kwargs_tp_on_gpu_uses_ray() -> None:
    kw = model(engine={"tensor_parallel_size": 2}, accelerator={"kind": "gpu"}).engine_kwargs("/m")
    assert kw["distributed_executor_backend"] == "ray"


def test_engine_kwargs_single_worker_leaves_backend_to_vllm() -> None:
    assert "distributed_executor_backend" not in model().engine_kwargs("/m")


def test_engine_kwargs_keeps_explicit_backend() -> None:
    cfg = model(
        engine={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
        accelerator={"kind": "gpu"},
    )
    assert cfg.engine_kwargs("/m")["distributed_executor_backend"] == "mp"


def test_engine_kwargs_passes_extra_through() -> None:
    kw = model(engine={"extra": {"swap_space": 2, "max_logprobs": 5}}).engine_kwargs("/m")
    assert kw["swap_space"] == 2 and kw["max_logprobs"] == 5


# ---- against vLLM's own AsyncEngineArgs ---------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_engine_args() -> type:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs


def test_typed_engine_fields_exist_in_vllm(vllm_engine_args: type) -> None:
    vllm_fields = {f.name for f in dataclasses.fields(vllm_engine_args)}
    ours = set(EngineArgs.model_fields) - {"extra"}
    assert ours - vllm_fields == set()
    # And the keys engine_kwargs adds on its own.
    assert {"model", "served_model_name", "runner", "disable_log_stats"} <= vllm_fields


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_shipped_configs_build_vllm_engine_args(vllm_engine_args: type, path: Path) -> None:
    for m in load_app_config(path).models:
        args = vllm_engine_args(**m.engine_kwargs("/nonexistent/model"))
        assert args.served_model_name == [m.id]


# ---- error mapping -----------------------------------------------------------------------------
def test_context_length_error_names_the_main_param() -> None:
    msg = "This model's maximum context length is 2048 tokens. However, you requested 3000 tokens."
    err = to_openai_error(400, msg, "input_tokens", main_param="prompt")
    assert isinstance(err, errors.ContextLengthExceeded)
    assert err.status == 400
    assert err.to_body()["error"] == {
        "message": msg,
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "context_length_exceeded",
    }


def test_other_400_keeps_vllm_param() -> None:
    err = to_openai_error(400, "temperature must be >= 0", "temperature")
    assert type(err) is errors.InvalidRequest
    assert (err.param, err.code) == ("temperature", "invalid_request")


@pytest.mark.parametrize(
    ("status", "cls", "code"),
    [
        (404, errors.NotFound, "not_found"),
        (503, errors.ServiceUnavailable, "service_unavailable"),
        (422, errors.InvalidRequest, "invalid_request"),
        (500, errors.InternalError, "internal_error"),
        (501, errors.InternalError, "internal_error"),
    ],
)
def test_status_maps_to_error_class(status: int, cls: type, code: str) -> None:
    err = to_openai_error(status, "m", None)
    assert type(err) is cls
    assert err.code == code


def test_503_from_engine_carries_retry_after() -> None:
    assert to_openai_error(503, "busy", None).headers["Retry-After"] == "1"


class ChatReq(BaseModel):
    messages: list[str]
    temperature: float = 1.0


def test_validation_error_names_the_field() -> None:
    with pytest.raises(ValidationError) as exc_info:
        ChatReq.model_validate({"messages": ["hi"], "temperature": "hot"})
    err = validation_error(exc_info.value)
    assert err.status == 400
    assert err.param == "temperature"
    assert err.message.startswith("temperature: ")


def test_validation_error_drops_union_member_class_name() -> None:
    class Other(BaseModel):
        input: int

    with pytest.raises(ValidationError) as exc_info:
        TypeAdapter(ChatReq | Other).validate_python({"messages": "not a list"})
    err = validation_error(exc_info.value)
    assert err.param == "messages"
    assert "ChatReq" not in err.message


# ---- coalesce ----------------------------------------------------------------------------------
def _server() -> EngineServer:
    return EngineServer(model(), "/dummy/path")


def _coalesce(source: AsyncIterator[Any], wants_usage: bool = True,
              meter: TokenMeter | None = None) -> AsyncIterator[Any]:
    """The relay as ``EngineServer.handle`` builds it, in a request context with ``meter`` set."""
    meter = meter if meter is not None else TokenMeter()
    context = contextvars.copy_context()
    context.run(current_meter.set, meter)
    return Coalescer(meter, _server()._map_exception, wants_usage=wants_usage).relay(source, context)


async def _chunks(parts: list[str], delays: list[float] | None = None) -> AsyncIterator[str]:
    """vLLM's SSE strings; a delay of 0 means "in the same burst" (no await in between)."""
    for i, part in enumerate(parts):
        if delays and delays[i] > 0:
            await asyncio.sleep(delays[i])
        yield part


async def _collect(source: AsyncIterator[str]) -> list[tuple[float, Any]]:
    t0 = time.monotonic()
    return [(time.monotonic() - t0, item) async for item in _coalesce(source)]


def _relayed(items: list[tuple[float, Any]]) -> list[bytes]:
    """The bytes of the chunks after the head; the stream ends with a trailer (token counts)."""
    rest = [i for _, i in items[1:]]
    assert rest and isinstance(rest[-1], dict)
    assert set(rest[-1]) == {"tokens"}  # accounting for the gateway, never SSE
    rest = rest[:-1]
    assert all(isinstance(c, tuple) and isinstance(c[0], bytes) and isinstance(c[1], int)
               for c in rest)
    return [c[0] for c in rest]


def _joined(items: list[tuple[float, Any]]) -> bytes:
    return items[0][1]["body"] + b"".join(_relayed(items))


def test_coalesce_first_item_is_stream_head_with_first_chunk() -> None:
    parts = [f"data: {{\"n\": {i}}}\n\n" for i in range(5)]
    items = asyncio.run(_collect(_chunks(parts, [0.0, 0.05, 0.05, 0.05, 0.05])))
    head = items[0][1]
    assert isinstance(head, dict)
    assert head["stream"] is True and head["status"] == 200
    assert head["body"].startswith(parts[0].encode())
    assert _joined(items) == "".join(parts).encode()


def test_coalesce_flushes_first_chunk_without_waiting_for_the_rest() -> None:
    parts = ["data: first\n\n", "data: second\n\n"]
    items = asyncio.run(_collect(_chunks(parts, [0.0, 0.5])))
    assert items[0][1]["body"] == parts[0].encode()
    assert items[0][0] < 0.3
    assert _joined(items) == "".join(parts).encode()


def test_coalesce_sends_each_burst_as_one_message() -> None:
    """One engine output becomes several SSE strings at once; they travel together."""
    parts = ["data: role\n\n", "data: tok1\n\n", "data: tok2-4\n\n", "data: usage\n\n",
             "data: [DONE]\n\n"]
    items = asyncio.run(_collect(_chunks(parts, [0.0, 0.0, 0.05, 0.05, 0.0])))
    assert items[0][1]["body"] == "".join(parts[:2]).encode()
    assert _relayed(items) == [parts[2].encode(), "".join(parts[3:]).encode()]


def test_coalesce_relays_each_output_as_soon_as_it_exists() -> None:
    """The pacing is upstream (PacedEngineClient); the relay itself never holds bytes back."""
    parts = ["data: role\n\n", "data: a\n\n", "data: b\n\n"]
    delays = [0.0, 0.2, 0.2]
    items = asyncio.run(_collect(_chunks(parts, delays)))
    stamps = [t for t, _ in items[:3]]
    assert stamps[0] < 0.1
    assert 0.15 < stamps[1] < 0.35 and 0.35 < stamps[2] < 0.55


def test_coalesce_empty_stream_still_sends_a_head() -> None:
    items = asyncio.run(_collect(_chunks([])))
    first = items[0][1]
    assert (first["status"], first["stream"], first["body"]) == (200, True, b"")
    assert _relayed(items) == []


def test_coalesce_engine_failure_ends_with_error_event_and_done() -> None:
    async def failing() -> AsyncIterator[str]:
        yield "data: 1\n\n"
        await asyncio.sleep(0.05)
        raise RuntimeError("engine core died")

    items = asyncio.run(_collect(failing()))
    data = _joined(items)
    assert data.startswith(b"data: 1\n\n")
    assert data.endswith(SSE_DONE)
    events = [e for e in data.split(b"\n\n") if e]
    error_event = json.loads(events[-2].removeprefix(b"data: "))
    assert set(error_event["error"]) == {"message", "type", "param", "code"}
    assert error_event["error"]["type"] == "server_error"


def test_coalesce_cancelling_consumer_cancels_producer() -> None:
    state: dict[str, bool] = {}

    async def endless() -> AsyncIterator[str]:
        try:
            yield "data: 1\n\n"
            await asyncio.Event().wait()
            yield "never"
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise
        finally:
            state["closed"] = True

    async def scenario() -> tuple[list[Any], dict[str, bool]]:
        got: list[Any] = []

        async def consume() -> None:
            async for item in _coalesce(endless()):
                got.append(item)

        task = asyncio.create_task(consume())
        for _ in range(200):
            if got:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Checked inside the loop: asyncio.run would cancel a leftover producer on its own.
        return got, dict(state)

    got, seen = asyncio.run(asyncio.wait_for(scenario(), 5))
    assert got and got[0]["stream"] is True
    assert seen == {"cancelled": True, "closed": True}


def test_coalesce_closing_consumer_early_cancels_producer() -> None:
    state: dict[str, bool] = {}

    async def endless() -> AsyncIterator[str]:
        try:
            yield "data: 1\n\n"
            await asyncio.Event().wait()
        finally:
            state["closed"] = True

    async def scenario() -> dict[str, bool]:
        agen = _coalesce(endless())
        first = await agen.__anext__()
        assert first["stream"] is True
        await agen.aclose()  # the client went away after the first token
        return dict(state)

    assert asyncio.run(asyncio.wait_for(scenario(), 5)) == {"closed": True}


# vLLM serialises its chunks as compact JSON.
USAGE_EVENT = (
    'data: {"id":"c1","choices":[],'
    '"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
)


@pytest.mark.parametrize("wants_usage", [True, False])
def test_coalesce_reports_usage_and_relays_it_only_when_asked(wants_usage: bool) -> None:
    parts = ['data: {"id":"c1","choices":[{"index":0}]}\n\n', USAGE_EVENT, "data: [DONE]\n\n"]

    async def run() -> list[Any]:
        return [i async for i in _coalesce(_chunks(parts), wants_usage)]

    items = asyncio.run(run())
    # One burst: the head has the whole answer, and with it the engine's final counts.
    assert len(items) == 1
    assert items[0]["tokens"] == {"prompt_tokens": 3, "completion_tokens": 2}
    relayed = items[0]["body"]
    assert (USAGE_EVENT.encode() in relayed) is wants_usage
    assert relayed.startswith(parts[0].encode()) and relayed.endswith(SSE_DONE)


@pytest.mark.parametrize("last", [
    [USAGE_EVENT, "data: [DONE]\n\n"],
    ['event: response.completed\ndata: {"type":"response.completed","response":{"usage":'
     '{"input_tokens":3,"output_tokens":2,"total_tokens":5}}}\n\n'],
    ['event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
     '"usage":{"input_tokens":1,"cache_read_input_tokens":2,"output_tokens":2}}\n\n',
     'event: message_stop\ndata: {"type":"message_stop"}\n\n'],
])
def test_coalesce_sends_the_final_counts_before_the_answers_last_events(last: list[str]) -> None:
    """An agent closes the connection on the answer's last event ([DONE], response.completed,
    message_stop): the trailer with the engine's counts (the prompt's too, which the meter may not
    have) is already in front of those bytes, so the gateway never waits for it."""
    parts = ["data: first\n\n", *last]

    async def run() -> list[Any]:
        return [i async for i in _coalesce(_chunks(parts, [0, 0.01] + [0] * (len(last) - 1)))]

    items = asyncio.run(run())
    assert items[0]["body"] == b"data: first\n\n"
    assert items[1] == {"tokens": {"prompt_tokens": 3, "completion_tokens": 2}}
    assert b"".join(i[0] for i in items[2:]) == "".join(last).encode()


def test_coalesce_chunks_carry_the_engines_count_and_the_trailer_has_it_without_usage() -> None:
    """A stream that ends without vLLM's usage chunk (an engine error) still reports the tokens
    the engine made, from the meter the paced client fills."""
    meter = TokenMeter(prompt_tokens=11)

    async def produce() -> AsyncIterator[str]:
        meter.completion_tokens = 1
        yield "data: first\n\n"
        await asyncio.sleep(0.01)
        meter.completion_tokens = 6  # pacing merged five tokens into the next event
        yield "data: second\n\n"
        await asyncio.sleep(0.01)
        raise RuntimeError("engine core died")

    async def run() -> list[Any]:
        return [i async for i in _coalesce(produce(), True, meter)]

    items = asyncio.run(run())
    assert items[0]["tokens"] == {"prompt_tokens": 11, "completion_tokens": 1}
    assert items[1] == (b"data: second\n\n", 6)
    assert items[-1] == {"tokens": {"prompt_tokens": 11, "completion_tokens": 6}}


def test_coalesce_runs_vllms_stream_with_the_requests_meter_set() -> None:
    """vLLM's serving layer calls the engine client's ``generate`` only as its stream is read, in
    the pump task: the paced client there must find this request's meter (it once found none, and
    every cut-short stream was charged 0 tokens)."""
    meter = TokenMeter()
    seen: list[TokenMeter | None] = []

    async def produce() -> AsyncIterator[str]:
        seen.append(current_meter.get())
        yield "data: x\n\n"

    async def run() -> list[Any]:
        return [i async for i in _coalesce(produce(), True, meter)]

    asyncio.run(run())
    assert seen == [meter]


# ---- handle: checks before vLLM, large complete answers in parts ---------------------------------
class _FakeServing:
    """A vLLM serving object: records its calls, answers with a starlette-like response."""

    def __init__(self, body: bytes) -> None:
        self.calls = 0
        self.body = body

    async def __call__(self, request: Any, raw_request: Any = None) -> Any:
        self.calls += 1
        return dataclasses.make_dataclass("R", ["status_code", "body"])(200, self.body)


def _handle(server: EngineServer, name: str, body: dict[str, Any]) -> list[Any]:
    from serve_app.protocol import ENDPOINTS, RequestContext

    async def run() -> list[Any]:
        ctx = RequestContext("r1", "k1", "standard")
        return [item async for item in server.handle(ENDPOINTS[name], body, ctx)]

    return asyncio.run(run())


def test_handle_refuses_what_vllm_would_leak_without_calling_it() -> None:
    from starlette.datastructures import State

    server = _server()
    server.state = State()
    serving = _FakeServing(b"{}")
    server.state.serving_embedding = serving
    for field, value in (("dimensions", 2**70), ("input", "\ud800"), ("dimensions", 2**40)):
        items = _handle(server, "embeddings", {"model": "m", "input": "hi", field: value})
        assert len(items) == 1 and items[0]["status"] == 400
        assert json.loads(items[0]["body"])["error"]["param"] == field
    assert serving.calls == 0


def test_handle_sends_a_large_complete_answer_in_parts() -> None:
    from starlette.datastructures import State

    from serve_app.protocol import PART_BYTES

    answer = json.dumps({"data": [{"embedding": [0.123456789] * 384}] * 1024,
                         "usage": {"prompt_tokens": 5, "total_tokens": 5}}).encode()
    assert len(answer) > 4 * 2**20
    server = _server()
    server.state = State()
    server.state.serving_embedding = _FakeServing(answer)
    first, *rest = _handle(server, "embeddings", {"model": "m", "input": "hi"})
    assert first["status"] == 200 and first["parts"] == len(rest) > 3
    assert all(len(p) <= PART_BYTES for p in [first["body"], *rest])
    assert first["body"] + b"".join(rest) == answer
    assert first["tokens"] == {"prompt_tokens": 5, "completion_tokens": 0}


def test_handle_runs_vllms_call_with_the_requests_meter_set() -> None:
    """A complete answer's ``generate`` happens inside vLLM's serving call: it runs in the
    request's context, with a meter of its own that is gone once the request is answered."""
    from starlette.datastructures import State

    seen: list[TokenMeter | None] = []

    class Serving(_FakeServing):
        async def __call__(self, request: Any, raw_request: Any = None) -> Any:
            seen.append(current_meter.get())
            return await super().__call__(request, raw_request)

    server = _server()
    server.state = State()
    server.state.serving_embedding = Serving(b'{"data": []}')
    [first] = _handle(server, "embeddings", {"model": "m", "input": "hi"})
    assert first["status"] == 200
    assert len(seen) == 1 and isinstance(seen[0], TokenMeter)
    assert current_meter.get() is None


def test_vllms_messages_conversion_still_calls_create_chat_completion_on_self() -> None:
    """The seam ``adapter.handler_for`` relies on: vLLM's Anthropic serving converts a Messages
    request and hands it to ``self.create_chat_completion``, and uses no zero-argument ``super()``
    (which would refuse the per-request view as ``self``)."""
    import inspect

    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    source = inspect.getsource(AnthropicServingMessages.create_messages)
    assert "self.to_chat_completion_request(" in source
    assert "self.create_chat_completion(" in source
    assert "super()" not in source
    assert hasattr(AnthropicServingMessages, "to_chat_completion_request")
