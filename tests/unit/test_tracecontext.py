"""W3C traceparent: a client's trace is continued, a bad one replaced, the replica gets our span."""

from __future__ import annotations

import pytest

from serve_app.gateway.accounting.tracecontext import TraceContext, parse_traceparent

CLIENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_valid_traceparent_is_parsed() -> None:
    assert parse_traceparent(CLIENT) == ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", 1)
    # A later version may add fields; version 00 may not.
    assert parse_traceparent("cc" + CLIENT[2:] + "-what-the-future-holds") is not None


@pytest.mark.parametrize("value", [
    "", "garbage", CLIENT.upper(), CLIENT + "-extra", "ff" + CLIENT[2:],
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
])
def test_an_invalid_traceparent_is_refused(value: str) -> None:
    assert parse_traceparent(value) is None


def test_the_clients_trace_continues_with_the_gateways_own_span() -> None:
    ctx = TraceContext.from_headers({"traceparent": CLIENT, "tracestate": "congo=t61rcWkgMzE"})
    assert ctx.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert ctx.parent_id == "00f067aa0ba902b7"
    assert ctx.span_id != ctx.parent_id and len(ctx.span_id) == 16
    assert ctx.headers() == {"traceparent": f"00-{ctx.trace_id}-{ctx.span_id}-01",
                             "tracestate": "congo=t61rcWkgMzE"}
    assert parse_traceparent(ctx.traceparent()) == (ctx.trace_id, ctx.span_id, 1)


def test_without_a_valid_traceparent_a_sampled_trace_starts() -> None:
    ids = iter(["00" * 16, "ab" * 16, "00" * 8, "cd" * 8])  # all-zero ids are never used
    ctx = TraceContext.from_headers({"traceparent": "bogus", "tracestate": "x=y"},
                                    new_hex=lambda n: next(ids))
    assert (ctx.trace_id, ctx.span_id, ctx.parent_id) == ("ab" * 16, "cd" * 8, None)
    assert ctx.sampled and ctx.headers() == {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"}


def test_an_unsampled_client_trace_stays_unsampled() -> None:
    ctx = TraceContext.from_headers({"traceparent": CLIENT[:-2] + "00"})
    assert not ctx.sampled and ctx.traceparent().endswith("-00")
