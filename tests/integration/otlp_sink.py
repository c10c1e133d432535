"""A real OTLP/HTTP trace receiver on loopback for the tests: the gateway's real exporter sends to
it, and it keeps every span it was sent, decoded with OpenTelemetry's own protobuf messages."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpSink:
    """``url`` is the endpoint to configure (``gateway.accounting.otlp_endpoint``)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                req = trace_service_pb2.ExportTraceServiceRequest()
                req.ParseFromString(body)
                got = [Span(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name,
                            s.kind, s.start_time_unix_nano, s.end_time_unix_nano,
                            {a.key: _value(a.value) for a in s.attributes})
                       for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
                with sink._lock:
                    sink.spans.extend(got)
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def of_trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
