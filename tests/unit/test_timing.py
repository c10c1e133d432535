"""Request clocks start at the front door's arrival stamp; each stage is timed and reported."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from serve_app.gateway.accounting import timing
from serve_app.gateway.accounting.timing import ArrivalStamp, StageClock, arrival_from_headers, stamp_seconds

NOW = 1_796_000_000.0


class _Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class _Sink:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str, float]] = []

    def stage_finished(self, *, tier: str, model: str, stage: str, seconds: float) -> None:
        self.seen.append((tier, model, stage, seconds))


@pytest.mark.parametrize("value", ["t=1796000000123456", "t=1796000000123", "t=1796000000.123456",
                                   "1796000000123456", "t=1796000000123456000"])
def test_stamp_in_any_unit_is_seconds_since_the_epoch(value: str) -> None:
    assert stamp_seconds(value) == pytest.approx(1_796_000_000.123456, abs=1e-3)


@pytest.mark.parametrize("value", ["", "t=", "t=abc", "t=-5", "1e9", "t=1 2", "t=" + "9" * 30])
def test_a_malformed_stamp_is_none(value: str) -> None:
    assert stamp_seconds(value) is None


def test_haproxys_stamp_is_the_arrival() -> None:
    stamp = NOW - 0.8
    assert arrival_from_headers({"x-request-start": f"t={int(stamp * 1e6)}"}, NOW) == pytest.approx(stamp)
    raw = [(b"X-Request-Start", f"t={int(stamp * 1e6)}".encode())]
    assert arrival_from_headers(raw, NOW) == pytest.approx(stamp)


@pytest.mark.parametrize("offset_s", [2.0, -601.0])
def test_a_stamp_from_the_future_or_too_old_is_ignored(offset_s: float) -> None:
    assert arrival_from_headers({"x-request-start": f"t={int((NOW + offset_s) * 1e6)}"}, NOW) is None


def test_no_stamp_is_none() -> None:
    assert arrival_from_headers({}, NOW) is None
    assert arrival_from_headers([(b"host", b"x")], NOW) is None


def test_asgi_middleware_records_when_the_app_first_saw_the_request() -> None:
    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen["arrival"] = timing.asgi_arrival(scope)

    mw = ArrivalStamp(app, clock=_Clock(NOW - 0.1))
    asyncio.run(mw({"type": "http", "headers": []}, None, None))
    assert seen["arrival"] == NOW - 0.1
    asyncio.run(mw({"type": "lifespan"}, None, None))
    assert seen["arrival"] is None


def _scope(stamp: float | None, entry: float | None) -> dict[str, Any]:
    headers = [] if stamp is None else [(b"x-request-start", f"t={int(stamp * 1e6)}".encode())]
    scope: dict[str, Any] = {"type": "http", "headers": headers}
    if entry is not None:
        scope[timing.SCOPE_KEY] = entry
    return scope


def test_a_request_with_a_trusted_stamp_starts_at_it_and_times_the_front_door() -> None:
    sc = StageClock.for_request(_scope(NOW - 0.5, NOW - 0.1), trust_stamp=True, clock=_Clock())
    assert sc.arrival == pytest.approx(NOW - 0.5)
    assert sc.durations() == {"front_door": pytest.approx(0.4)}
    assert sc.ttft_s() == pytest.approx(0.5)


def test_an_untrusted_stamp_is_ignored_and_the_asgi_arrival_is_used() -> None:
    # Behind Ray's proxy actor the header is whatever the client sent.
    sc = StageClock.for_request(_scope(NOW - 100, NOW - 0.1), trust_stamp=False, clock=_Clock())
    assert sc.arrival == NOW - 0.1
    assert sc.durations() == {}


def test_without_any_stamp_the_clock_starts_now() -> None:
    sc = StageClock.for_request(_scope(None, None), trust_stamp=True, clock=_Clock())
    assert sc.arrival == NOW and not sc.marked("front_door")


def test_stages_follow_each_other_and_reach_the_client_as_server_timing() -> None:
    clock = _Clock(NOW)
    sc = StageClock(NOW - 0.010, clock=clock)
    sc.mark("front_door", at=NOW - 0.008)
    sc.mark("parse_auth", at=NOW - 0.0077)
    sc.mark("admission", at=NOW - 0.005)
    sc.mark("handle", at=NOW + 0.020)  # from the replica's clock
    clock.t = NOW + 0.120
    sc.mark("engine")
    assert list(sc.durations()) == ["front_door", "parse_auth", "admission", "handle", "engine"]
    assert sc.durations()["engine"] == pytest.approx(0.100)
    assert sc.server_timing() == ("front_door;dur=2.0, parse_auth;dur=0.3, admission;dur=2.7, "
                                  "handle;dur=25.0, engine;dur=100.0, total;dur=130.0")
    assert sc.ttft_s() == pytest.approx(0.130)


def test_clock_skew_never_gives_a_negative_stage() -> None:
    sc = StageClock(NOW, clock=_Clock(NOW + 1))
    sc.mark("admission", at=NOW + 0.5)
    sc.mark("handle", at=NOW + 0.4)  # the replica's clock is a little behind
    sc.mark("engine", at=NOW + 0.6)
    assert sc.durations() == {"admission": 0.5, "handle": 0.0, "engine": pytest.approx(0.1)}


@pytest.mark.parametrize("stages", [("nap",), ("engine", "engine"), ("engine", "admission")])
def test_marks_out_of_order_twice_or_unknown_are_refused(stages: tuple[str, ...]) -> None:
    sc = StageClock(NOW, clock=_Clock())
    with pytest.raises(ValueError):
        for stage in stages:
            sc.mark(stage)


def test_each_stage_is_observed_once_per_request() -> None:
    sink = _Sink()
    sc = StageClock(NOW - 1, clock=_Clock())
    sc.mark("front_door", at=NOW - 0.5)
    sc.mark("relay")
    sc.observe(sink, tier="premium", model="tiny-chat")
    sc.observe(sink, tier="premium", model="tiny-chat")
    assert sink.seen == [("premium", "tiny-chat", "front_door", 0.5),
                         ("premium", "tiny-chat", "relay", 0.5)]


def test_stages_are_the_documented_ones() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs/OBSERVABILITY.md").read_text()
    for stage in timing.STAGES:
        assert f"`{stage}`" in doc, stage
