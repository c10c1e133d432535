"""loadtests.soak reads /v1/usage for its verdict once the gateway has booked every request: at
once when the books already match the client, after a quiet spell when they never will."""

from __future__ import annotations

from typing import Any

from loadtests.soak import Usage, settled_usage
from tests.unit.fakes import StepClock


def _usage(requests: int) -> Usage:
    return {"premium": {"requests": requests, "completion_tokens": 10 * requests}}


def _settle(readings: list[Usage], want: int, **kw: Any) -> tuple[Usage, float, int]:
    clock = StepClock(0.0)
    reads = iter(readings)
    last: list[Usage] = []

    def read() -> Usage:
        last[:] = [next(reads, last[0] if last else readings[-1])]
        return last[0]

    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        clock.step(s)

    got = settled_usage(read, lambda u: u["premium"]["requests"] == want, sleep, clock, **kw)
    return got, clock.now, len(sleeps)


def test_books_that_match_at_once_are_read_once() -> None:
    got, waited, polls = _settle([_usage(5)], want=5)
    assert got == _usage(5) and waited == 0 and polls == 0


def test_books_that_lag_are_read_until_they_match() -> None:
    got, waited, _ = _settle([_usage(3), _usage(4), _usage(4), _usage(5), _usage(6)], want=5)
    assert got == _usage(5) and waited == 0.75


def test_books_that_never_match_are_returned_after_a_quiet_spell() -> None:
    # 4 of 5 requests booked and nothing changes: the verdict gets the reading after quiet_s.
    got, waited, _ = _settle([_usage(3), _usage(4)], want=5, quiet_s=2.0)
    assert got == _usage(4) and waited == 2.25  # 0.25 s to the change, then 2 s without one


def test_a_reading_that_keeps_changing_stops_at_the_timeout() -> None:
    got, waited, _ = _settle([_usage(n) for n in range(1000)], want=-1, quiet_s=2.0, timeout_s=10.0)
    assert waited == 10.0 and got == _usage(40)
