"""OpenTelemetry spans of a request's stages, exported over OTLP when an endpoint is configured.

Off by default: nothing here is imported or built unless the gateway is given an OTLP endpoint.
Spans are made after the fact from a ``StageClock`` (one ``gateway`` span from the arrival to the
end, one child per stage) rather than opened live, so a request pays for tracing only once, at its
end, and only when sampled. The ``gateway`` span has the span id already sent to the model replica
in ``traceparent`` (``TraceContext.span_id``), so the replica's and vLLM's spans hang under it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from serve_app.gateway.accounting.genai import AttributeValue
from serve_app.gateway.accounting.timing import StageClock
from serve_app.gateway.accounting.tracecontext import TraceContext

if TYPE_CHECKING:
    from opentelemetry.context import Context


class _PresetIds(IdGenerator):
    """Random ids, except the next trace or span id when one is preset (the gateway's own)."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self.next_trace_id: int | None = None
        self.next_span_id: int | None = None

    def generate_span_id(self) -> int:
        preset, self.next_span_id = self.next_span_id, None
        return preset if preset is not None else self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        preset, self.next_trace_id = self.next_trace_id, None
        return preset if preset is not None else self._random.generate_trace_id()


# The stages spent in the model replica and the engine (``timing.STAGES``): the model call.
MODEL_STAGES = frozenset({"handle", "engine", "relay"})


def _ns(t: float) -> int:
    return int(t * 1e9)


class StageSpans:
    """Exports each sampled request's stages as spans (``export`` after the request ends)."""

    def __init__(self, exporter: SpanExporter, *, service_name: str = "serve-app-gateway",
                 batch: bool = True) -> None:
        self._ids = _PresetIds()
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                                        id_generator=self._ids)
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("serve_app.gateway")

    @classmethod
    def otlp(cls, endpoint: str, **kwargs: Any) -> StageSpans:
        """Spans to an OTLP/HTTP collector (``http://host:4318/v1/traces``)."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls(OTLPSpanExporter(endpoint=endpoint), **kwargs)

    def export(self, ctx: TraceContext, clock: StageClock, *, end: float | None = None,
               attributes: Mapping[str, str | int | float] | None = None,
               call: Mapping[str, AttributeValue] | None = None, call_name: str = "") -> None:
        """The ``gateway`` span (arrival -> ``end``) and its stage children; nothing if unsampled.
        With ``call`` (the model call's ``gen_ai.*`` attributes), one more child, ``call_name``,
        a CLIENT span from the hand-off to the model (the end of the gateway's own stages) to the
        end: the engine's time, apart from the gateway's.
        Synchronous and not re-entrant: call it from the event loop's thread only."""
        if not ctx.sampled:
            return
        parent: Context | None = None
        if ctx.parent_id is not None:
            remote = SpanContext(int(ctx.trace_id, 16), int(ctx.parent_id, 16), is_remote=True,
                                 trace_flags=TraceFlags(ctx.flags))
            parent = trace.set_span_in_context(NonRecordingSpan(remote))
        else:
            self._ids.next_trace_id = int(ctx.trace_id, 16)
        self._ids.next_span_id = int(ctx.span_id, 16)
        finish = clock.clock() if end is None else end
        root = self._tracer.start_span("gateway", context=parent, start_time=_ns(clock.arrival),
                                       attributes=dict(attributes or {}))
        inside = trace.set_span_in_context(root)
        start = clock.arrival
        handed_off = None  # when the gateway's own stages ended: the model call's start
        for stage, seconds in clock.durations().items():
            if stage in MODEL_STAGES and handed_off is None:
                handed_off = start
            span = self._tracer.start_span(stage, context=inside, start_time=_ns(start))
            span.end(end_time=_ns(start + seconds))
            start += seconds
        end_ns = _ns(max(finish, start))
        if call is not None:
            span = self._tracer.start_span(call_name or "model call", context=inside,
                                           kind=trace.SpanKind.CLIENT,
                                           start_time=_ns(handed_off if handed_off is not None
                                                          else start),
                                           attributes=dict(call))
            span.end(end_time=end_ns)
        root.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Flush what is queued and stop (replica shutdown)."""
        self._provider.shutdown()
