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
