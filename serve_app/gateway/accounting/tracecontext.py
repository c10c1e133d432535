"""W3C Trace Context: accept a client's ``traceparent``, or start a trace, and pass it on.

The gateway is one span of the trace: it keeps the client's trace id (or makes one), takes a new
span id of its own, and sends ``traceparent`` with that span id to the model replica, which hands it
to vLLM (``trace_headers``) so the engine's spans, when vLLM traces, hang under the gateway's. A
malformed header is ignored as the spec says (a new trace starts); ``tracestate`` is passed on only
with a valid ``traceparent``.
https://www.w3.org/TR/trace-context/
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass

_HEX = "0123456789abcdef"
# version-traceid-parentid-flags; a later version may append fields after a "-".
_PARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
MAX_TRACESTATE = 512  # the spec's limit on what a vendor must propagate
SAMPLED = 0x01


def parse_traceparent(value: str) -> tuple[str, str, int] | None:
    """(trace id, parent span id, flags) of a valid ``traceparent``, else None."""
    m = _PARENT.match(value.strip())
    if m is None:
        return None
    version, trace_id, parent_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return trace_id, parent_id, int(flags, 16)


@dataclass(frozen=True)
class TraceContext:
    """This request's place in a trace: the gateway's own span and the client's, if it sent one."""

    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits: the gateway's span, the parent of the model replica's work
    parent_id: str | None  # the client's span
    flags: int
    tracestate: str | None = None

    @classmethod
    def from_headers(cls, headers: Mapping[str, str],
                     new_hex: Callable[[int], str] = secrets.token_hex) -> TraceContext:
        """Continue the client's trace (lower-case header names, or Starlette's ``Headers``), or
        start a sampled one."""
        parsed = parse_traceparent(headers.get("traceparent", ""))
        if parsed is None:
            return cls(_nonzero(new_hex, 16), _nonzero(new_hex, 8), None, SAMPLED)
        trace_id, parent_id, flags = parsed
        state = headers.get("tracestate")
        if state is not None and len(state) > MAX_TRACESTATE:
            state = None
        return cls(trace_id, _nonzero(new_hex, 8), parent_id, flags, state)

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)

    def traceparent(self) -> str:
        """The header for the model replica (and vLLM): this trace, the gateway's span as parent."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags:02x}"

    def headers(self) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) to propagate, JSON-serialisable."""
        out = {"traceparent": self.traceparent()}
        if self.tracestate:
            out["tracestate"] = self.tracestate
        return out


def _nonzero(new_hex: Callable[[int], str], nbytes: int) -> str:
    while True:
        value = new_hex(nbytes)
        if value.strip("0"):
            return value
