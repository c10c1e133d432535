"""Where a request's time goes, measured from its arrival at the front door.

The clock of every latency the gateway reports (TTFT, E2E, each objective) starts at the request's
arrival, not when the gateway's code first sees it: under load a request can wait a second in
HAProxy's and the replica's queues before the event loop reads it, and that second is part of what
the client waits for.

- Arrival: HAProxy sets ``X-Request-Start: t=<microseconds since the epoch>`` when it has read the
  request head (``serve_app.local.front_door``; a client's own header is deleted first). Where no
  trusted stamp exists (Ray's proxy actor as the front door, or a caller that reached a replica's
  loopback port directly), the time the gateway's ASGI app first saw the request is the arrival
  (``ArrivalStamp`` records it).
- Stages: ``StageClock`` records the end of each stage in ``STAGES`` order; a stage lasts from the
  previous mark (or the arrival) to its own. Each is observed into ``serve_app_stage_seconds``
  (tier, model, stage) and the ones known when the response head is sent go out in the W3C
  ``Server-Timing`` header, which browsers' devtools and ``curl -v`` show.

Times are wall-clock (``time.time()``) because two of them come from other processes (HAProxy and
the model replica); a stage that clock skew makes negative counts as 0.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

# Set (to "1") in the Ray processes' environment by the front door that deletes a client's own
# X-Request-Start and stamps its own (``serve_app.local.front_door``). Only then is the header
# trusted: Ray's stock HAProxy (a KubeRay cluster without the project's rules) passes a client's
# header through, and a forged stamp would move the SLA clock and the autoscaler.
STAMPING_FRONT_DOOR_ENV = "SERVE_APP_STAMPING_FRONT_DOOR"


def trusts_arrival_stamp(haproxy: bool, env: Mapping[str, str]) -> bool:
    """Whether ``X-Request-Start`` is the front door's own: HAProxy is the front door and the
    project's rules stamp it (``STAMPING_FRONT_DOOR_ENV``)."""
    return haproxy and env.get(STAMPING_FRONT_DOOR_ENV) == "1"


# One line each in docs/OBSERVABILITY.md ("Where the time goes").
STAGES = (
    "front_door",  # HAProxy has read the request head -> the gateway's ASGI app sees it
    "parse_auth",  # route, body parsing, key check, model routing
    "admission",  # tier policy, rate limits (Redis), capacity
    "queue",  # the gateway's own wait before a slot is free (flow control; 0 without it)
    "handle",  # Ray Serve handle and the model replica's queue, until the replica starts it
    "engine",  # replica start -> first token (engine queue and prefill)
    "relay",  # first token at the replica -> its first byte written to the client
)
HEADER = "x-request-start"
SCOPE_KEY = "serve_app.arrival"  # where ArrivalStamp puts the ASGI arrival time in the scope
MAX_FUTURE_S = 1.0  # a stamp this far ahead of the gateway's clock is not believed
MAX_AGE_S = 600.0  # nor one older than this (a request that old has timed out anyway)
_STAMP = re.compile(r"^\s*(?:t=)?(\d{1,20}(?:\.\d{1,9})?)\s*$")


def stamp_seconds(value: str) -> float | None:
    """``t=<number>`` as seconds since the epoch, whatever its unit (s, ms, µs or ns, told apart by
    magnitude as New Relic does); None if it is not such a number."""
    m = _STAMP.match(value)
    if m is None:
        return None
    t = float(m.group(1))
    # Seconds since the epoch are ~1.8e9 now; each smaller unit multiplies by 1000.
    for divisor in (1.0, 1e3, 1e6, 1e9):
        if t / divisor < 1e11:
            return t / divisor
    return None


def arrival_from_headers(headers: Mapping[str, str] | Iterable[tuple[bytes, bytes]],
                         now: float) -> float | None:
    """The front door's arrival stamp as a ``time.time()`` value, or None when there is none or it
    is not sane (more than ``MAX_FUTURE_S`` ahead of ``now`` or more than ``MAX_AGE_S`` behind).

    ``headers`` is a case-insensitive mapping (Starlette's ``Headers``, with lower-case keys for a
    plain dict) or an ASGI scope's raw header list. Only call this when the front door is HAProxy,
    which replaces any client-supplied ``X-Request-Start``; behind Ray's proxy actor the header is
    the client's own and must be ignored.
    """
    raw: str | None
    if isinstance(headers, Mapping):
        raw = headers.get(HEADER)
    else:
        raw = next((v.decode("latin-1") for k, v in headers if k.lower() == HEADER.encode()), None)
    if raw is None:
        return None
    t = stamp_seconds(raw)
    if t is None or t > now + MAX_FUTURE_S or t < now - MAX_AGE_S:
        return None
    return t


class ArrivalStamp:
    """Pure ASGI middleware: the time the app first saw each request, in ``scope[SCOPE_KEY]``.

    Mount it outermost (``app.add_middleware(ArrivalStamp)`` last, or wrap the app) so nothing of
    the gateway's own runs before the stamp is taken. ``asgi_arrival(request.scope)`` reads it.
    """

    def __init__(self, app: Any, clock: Callable[[], float] = time.time) -> None:
        self.app = app
        self.clock = clock

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope[SCOPE_KEY] = self.clock()
        await self.app(scope, receive, send)


def asgi_arrival(scope: Mapping[str, Any]) -> float | None:
    """The time ``ArrivalStamp`` recorded for this request, if it is mounted."""
    t = scope.get(SCOPE_KEY)
    return float(t) if isinstance(t, int | float) else None


class StageSink(Protocol):
    """Where finished stages go (``serve_app.metrics.StageMetrics``)."""

    def stage_finished(self, *, tier: str, model: str, stage: str, seconds: float) -> None: ...


class StageClock:
    """One request's stage boundaries, from its arrival; durations, Server-Timing, TTFT.

    ``mark(stage)`` ends ``stage`` now (or ``at``, a ``time.time()`` value from another process,
    such as the model replica's start). Marks follow ``STAGES`` order; a stage that is not marked
    has its time counted in the next one that is, and is left out of the durations.
    """

    def __init__(self, arrival: float, *, clock: Callable[[], float] = time.time) -> None:
        self.arrival = arrival
        self.clock = clock
        self._marks: dict[str, float] = {}
        self._observed = False

    @classmethod
    def for_request(cls, scope: Mapping[str, Any], *, trust_stamp: bool,
                    clock: Callable[[], float] = time.time) -> StageClock:
        """The clock of one HTTP request: from HAProxy's stamp when ``trust_stamp`` (HAProxy is the
        front door) and the stamp is sane, with ``front_door`` ended at the ASGI arrival; otherwise
        from the ASGI arrival (or now, without ``ArrivalStamp``), with no ``front_door`` stage."""
        now = clock()
        entry = asgi_arrival(scope)
        entry = now if entry is None else entry
        stamp = arrival_from_headers(scope.get("headers") or [], now) if trust_stamp else None
        if stamp is None:
            return cls(entry, clock=clock)
        sc = cls(min(stamp, entry), clock=clock)
        sc.mark("front_door", at=entry)
        return sc

    def mark(self, stage: str, at: float | None = None) -> float:
        """End ``stage`` at ``at`` (default: now); returns the time recorded. Raises ValueError for
        an unknown stage, a stage marked twice, or one marked after a later stage."""
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
        if stage in self._marks:
            raise ValueError(f"stage {stage!r} was already marked")
        if self._marks and STAGES.index(stage) < STAGES.index(next(reversed(self._marks))):
            raise ValueError(f"stage {stage!r} marked after {next(reversed(self._marks))!r}")
        t = self.clock() if at is None else at
        self._marks[stage] = t
        return t

    def marked(self, stage: str) -> bool:
        return stage in self._marks

    def durations(self) -> dict[str, float]:
        """Seconds per marked stage, in order; each from the previous mark (or the arrival), and
        never below 0 (clocks of two processes may disagree by a little)."""
        out: dict[str, float] = {}
        prev = self.arrival
        for stage, t in self._marks.items():
            out[stage] = max(0.0, t - prev)
            prev = max(prev, t)
        return out

    def elapsed_s(self, now: float | None = None) -> float:
        """Seconds since the arrival."""
        return max(0.0, (self.clock() if now is None else now) - self.arrival)

    def ttft_s(self, now: float | None = None) -> float:
        """Time to first token as the client sees it: from the arrival to ``now`` (call it when the
        first token is handed to the client). Also the E2E latency when called at the end."""
        return self.elapsed_s(now)

    def server_timing(self) -> str:
        """The ``Server-Timing`` header value for the stages marked so far, in milliseconds
        (``front_door;dur=1.2, parse_auth;dur=0.3, ...``), and ``total`` since the arrival."""
        parts = [f"{stage};dur={s * 1000:.1f}" for stage, s in self.durations().items()]
        parts.append(f"total;dur={self.elapsed_s() * 1000:.1f}")
        return ", ".join(parts)

    def observe(self, sink: StageSink, *, tier: str, model: str) -> None:
        """Every marked stage into ``sink``, once per request (later calls do nothing), so a
        request that ends on several paths is counted once."""
        if self._observed:
            return
        self._observed = True
        for stage, seconds in self.durations().items():
            if math.isfinite(seconds):
                sink.stage_finished(tier=tier, model=model, stage=stage, seconds=seconds)
