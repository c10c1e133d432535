"""Stage spans: one gateway span with the span id the replica was given, a child per stage."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from serve_app.gateway.accounting.otel import StageSpans
from serve_app.gateway.accounting.timing import StageClock
from serve_app.gateway.accounting.tracecontext import TraceContext

NOW = 1_796_000_000.0
CLIENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _clock() -> StageClock:
    sc = StageClock(NOW, clock=lambda: NOW + 0.5)
    sc.mark("front_door", at=NOW + 0.1)
    sc.mark("admission", at=NOW + 0.15)
    sc.mark("engine", at=NOW + 0.4)
    return sc


def test_the_clients_trace_gets_the_gateway_span_and_its_stages() -> None:
    out = InMemorySpanExporter()
    spans = StageSpans(out, batch=False)
    ctx = TraceContext.from_headers({"traceparent": CLIENT})

    spans.export(ctx, _clock(), attributes={"tier": "premium"})

    got = {s.name: s for s in out.get_finished_spans()}
    assert set(got) == {"gateway", "front_door", "admission", "engine"}
    root = got["gateway"]
    assert f"{root.context.trace_id:032x}" == ctx.trace_id
    assert f"{root.context.span_id:016x}" == ctx.span_id  # what the replica got as parent
    assert root.parent is not None and f"{root.parent.span_id:016x}" == ctx.parent_id
    assert (root.start_time, root.end_time) == (int(NOW * 1e9), int((NOW + 0.5) * 1e9))
    assert root.attributes == {"tier": "premium"}
    for stage in ("front_door", "admission", "engine"):
        assert got[stage].parent is not None and got[stage].parent.span_id == root.context.span_id
    assert got["engine"].end_time - got["engine"].start_time == pytest.approx(250_000_000, abs=1_000)
    spans.shutdown()


def test_a_new_trace_uses_our_ids_and_an_unsampled_one_exports_nothing() -> None:
    out = InMemorySpanExporter()
    spans = StageSpans(out, batch=False)
    ctx = TraceContext.from_headers({})
    spans.export(ctx, _clock())
    root = next(s for s in out.get_finished_spans() if s.name == "gateway")
    assert f"{root.context.trace_id:032x}" == ctx.trace_id and root.parent is None
    out.clear()
    spans.export(TraceContext.from_headers({"traceparent": CLIENT[:-2] + "00"}), _clock())
    assert out.get_finished_spans() == ()
    spans.shutdown()


def test_the_model_call_is_a_genai_client_span_of_its_own() -> None:
    from opentelemetry.trace import SpanKind

    from serve_app.gateway.accounting.genai import GenAiCall, request_attributes
    from serve_app.protocol import ENDPOINTS, tokens_of

    out = InMemorySpanExporter()
    spans = StageSpans(out, batch=False)
    sc = StageClock(NOW, clock=lambda: NOW + 0.5)
    sc.mark("parse_auth", at=NOW + 0.01)
    sc.mark("admission", at=NOW + 0.02)
    sc.mark("handle", at=NOW + 0.05)
    sc.mark("engine", at=NOW + 0.2)
    body = {"model": "tiny", "max_completion_tokens": 64, "temperature": 0.5, "top_p": "x",
            "stream": True}
    call = GenAiCall("chat", request_attributes(ENDPOINTS["chat"], body))
    spans.export(TraceContext.from_headers({"traceparent": CLIENT}), sc,
                 call=call.attributes("tiny-chat", 200, tokens_of(12, 7), 0.2),
                 call_name=call.span_name())
    got = {s.name: s for s in out.get_finished_spans()}
    model = got["chat tiny"]
    root = got["gateway"]
    assert model.kind is SpanKind.CLIENT and model.parent.span_id == root.context.span_id
    # From the hand-off to the model (the end of admission) to the end of the answer.
    assert (model.start_time, model.end_time) == (int((NOW + 0.02) * 1e9), int((NOW + 0.5) * 1e9))
    assert dict(model.attributes) == {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "vllm",
        "gen_ai.request.model": "tiny", "gen_ai.response.model": "tiny-chat",
        "gen_ai.request.max_tokens": 64, "gen_ai.request.temperature": 0.5,
        "gen_ai.request.stream": True,  # top_p "x" is not a number: no attribute
        "gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 7, "serve_app.ttft_s": 0.2}
    spans.shutdown()


def test_a_failed_call_says_its_error_and_an_endpoint_without_a_model_has_no_call() -> None:
    from serve_app.gateway.accounting.genai import GenAiCall
    from serve_app.protocol import ENDPOINTS

    attrs = GenAiCall("chat").attributes("tiny-chat", 504, None, None)
    assert attrs["error.type"] == "504" and "gen_ai.usage.input_tokens" not in attrs
    assert attrs["gen_ai.request.model"] == "tiny-chat"
    assert {e.name for e in ENDPOINTS.values() if e.operation} == {
        "chat", "completions", "embeddings", "responses", "messages"}


def test_a_request_through_the_gateway_exports_its_model_call(tmp_path) -> None:
    from tests.unit.test_api import CHAT, Env

    env = Env(tmp_path)
    out = InMemorySpanExporter()
    env.client.app.state.deps.usage.spans = StageSpans(out, batch=False)  # type: ignore[attr-defined]
    with env.client:
        r = env.post("/v1/chat/completions", {**CHAT, "max_tokens": 5}, key=env.all_key,
                     headers={"traceparent": CLIENT})
        assert r.status_code == 200
    got = {s.name: s for s in out.get_finished_spans()}
    call = got["chat tiny"]
    assert call.attributes["gen_ai.response.model"] == "tiny-chat"
    assert call.attributes["gen_ai.request.max_tokens"] == 5
    assert f"{call.context.trace_id:032x}" == CLIENT.split("-")[1]
