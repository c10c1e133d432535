"""Autoscaling a model on the top tier's objective: its TTFT and its wait, not only ongoing requests.

Ray Serve's default policy scales on ongoing requests per replica. That number says nothing about
whether the top-priority tier ("premium") still meets its TTFT objective: a replica can hold few
requests with long prompts and miss it, or many short ones and meet it easily. This module gives
Ray Serve 2.60 a custom policy (``AutoscalingConfig.policy``) that scales on the objective itself.

How the signal gets to the policy (the simplest correct route). The policy runs in Ray Serve's
controller and sees, per deployment, ``AutoscalingContext``: replica counts, ongoing requests, and
the custom metrics each replica returns from ``record_autoscaling_stats`` (Ray 2.60 calls it every
``min(look_back_period_s / 5, metrics_interval_s)`` and pushes the series every
``metrics_interval_s``, 10 s by default; Ray marks that field deprecated in favour of
``RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S``, which 2.60 does not read yet). The model replica already has every fact needed, because the gateway sends
them with each request (``protocol.RequestContext``): the tier's ``priority`` and the front door's
``arrival`` stamp. So the replica measures, for the top tier's streams, from that arrival:

- TTFT: until its first item is ready (``Head.timing.first``). This is the gateway's TTFT (the
  ``serve_app_ttft_seconds`` histogram) minus the relay of the first token back to the client, a few
  milliseconds; it includes every queue in front of the engine.
- Wait: until the replica started the request (``Head.timing.start``): the gateway's own queue
  (flow control), admission and Ray Serve's handle queue, the ``queue`` and ``handle`` stages of
  ``gateway/timing.py``. A queue that builds shows here before it shows in TTFT.

``TopTierWindow`` keeps those over the replica's last ``window_s`` (top-tier streams still waiting
for their first token count with their age so far, so a stuck engine shows before its requests
end) and ``ModelServer.record_autoscaling_stats`` reports their p95s. Other routes were weighed and
are heavier for no gain: the gateway's Prometheus histograms (needs Prometheus in the loop and adds
its scrape interval to the reaction time), the gateway pushing its own signal to the controller
(a second channel beside Ray's), or Redis (not every deployment has one).

The policy (``decide``, a pure function of the signals, the replica counts, its state and the time,
so tests drive it with fake contexts and a fake clock):

- Up by one replica (or more, if ongoing requests ask for more) once the top tier's TTFT p95 reaches
  ``up_at`` of the objective, or its wait reaches ``wait_up_at`` of it or keeps rising past half of
  that, or ongoing requests exceed ``target_ongoing_requests`` per replica (Ray's own rule, kept), for
  ``upscale_delay_s`` without a break.
- Down by one only after ``downscale_delay_s`` without a break in which the p95s stay under
  ``down_at`` of the objective and the ongoing requests would fit one replica fewer, both under
  ``target_ongoing_requests`` and under the per-replica load at which the tier last got hot, scaled
  by ``down_at / up_at`` (learnt hysteresis: a load that needed two replicas does not get one).
- Nothing while a change is under way (replicas starting or stopping), then nothing for ``window_s``
  more, so that the p95s describe the new count before they are believed.
- Always within ``min_replicas``..``max_replicas`` (as Ray adjusts them for target capacity).

The policy owns the delays: ``autoscaling_options`` passes ``upscale_delay_s``/``downscale_delay_s`` to
it and sets Ray's own to 0, so that the two do not add up.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from serve_app.config import AppConfig, AutoscalingConfig
from serve_app.protocol import RequestContext

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

logger = logging.getLogger("ray.serve")

# The custom metrics each model replica reports (ModelServer.record_autoscaling_stats).
TTFT_METRIC = "top_tier_ttft_p95_s"
WAIT_METRIC = "top_tier_wait_p95_s"
COUNT_METRIC = "top_tier_requests"
# Requests in flight in the replica: they reach it through its own endpoint (engine.endpoint), so
# Ray Serve's own count of ongoing requests does not see them.
ONGOING_METRIC = "ongoing_requests"
POLICY_PATH = f"{__name__}:ObjectivePolicy"
RISING_SAMPLES = 3  # the wait "keeps rising" when this many reports in a row each rose


def p95(values: Iterable[float]) -> float:
    """The nearest-rank 95th percentile (0 for no values)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[math.ceil(0.95 * len(ordered)) - 1]


# ---- in the model replica: the top tier's recent TTFT and wait ---------------------------------
class TopTierWindow:
    """The top tier's streams over the last ``window_s`` seconds, as this replica saw them.

    ``begin`` when the replica starts a request, ``first`` when its head is ready, ``end`` when it
    is over (however it ends); ``stats`` gives the p95s the policy reads. Only streams count: a
    complete answer's head comes at its end, so it has no TTFT (the gateway's histogram counts
    streams only, too). Times are ``time.time()`` values, as the front door's arrival stamp is.
    """

    def __init__(self, top_priority: int, window_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.top_priority = top_priority
        self.window_s = window_s
        self.clock = clock
        self._done: deque[tuple[float, float, float]] = deque()  # (first, ttft, wait), by first
        self._waiting: dict[int, tuple[float, float]] = {}  # token -> (arrival, start)
        self._next = 0

    def begin(self, ctx: RequestContext, stream: bool, start: float) -> int | None:
        """A token for a top-tier stream that the replica starts at ``start``; None otherwise."""
        if not stream or ctx.priority != self.top_priority:
            return None
        arrival = min(ctx.arrival, start) if ctx.arrival else start
        self._next += 1
        self._waiting[self._next] = (arrival, start)
        return self._next

    def first(self, token: int | None, at: float, ok: bool) -> None:
        """The request's head was ready at ``at``; an error head (``ok`` False) is not a TTFT."""
        entry = self._waiting.pop(token, None) if token is not None else None
        if entry is None:
            return
        if ok:
            arrival, start = entry
            self._done.append((at, max(0.0, at - arrival), start - arrival))
            self._trim(at)  # bounded even if Ray stopped asking for stats

    def end(self, token: int | None) -> None:
        """The request is over; one that never had a head (cancelled, failed) stops counting."""
        if token is not None:
            self._waiting.pop(token, None)

    def stats(self) -> dict[str, float]:
        """The p95 TTFT and wait of the window's top-tier streams, and how many there were."""
        now = self.clock()
        self._trim(now)
        ttfts = [t for _, t, _ in self._done]
        waits = [w for _, _, w in self._done]
        for arrival, start in self._waiting.values():  # lower bounds of what they will be
            ttfts.append(max(0.0, now - arrival))
            waits.append(start - arrival)
        return {TTFT_METRIC: p95(ttfts), WAIT_METRIC: p95(waits), COUNT_METRIC: float(len(ttfts))}

    def _trim(self, now: float) -> None:
        while self._done and self._done[0][0] < now - self.window_s:
            self._done.popleft()


# ---- in the controller: the policy ---------------------------------------------------------------
@dataclass(frozen=True)
class Params:
    """The policy's settings: the objective in seconds, the fractions of it that trigger a change
    (``ObjectivePolicyConfig``) and the holds (``AutoscalingConfig``'s delays)."""

    objective_s: float | None  # None: scale on ongoing requests only (no objective_policy)
    up_at: float = 0.8
    wait_up_at: float = 0.5
    down_at: float = 0.5
    window_s: float = 30.0
    min_samples: int = 10
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0


@dataclass(frozen=True)
class Signals:
    """What the replicas reported, over all of them: the worst p95s among the replicas with at
    least ``min_samples`` top-tier requests (None when none has), whether one's wait keeps rising,
    and Ray Serve's ongoing requests (running and queued, averaged over ``look_back_period_s``)."""

    ttft_s: float | None = None
    wait_s: float | None = None
    wait_rising: bool = False
    ongoing: float = 0.0


@dataclass(frozen=True)
class Replicas:
    """Replica counts: running now, Ray's current target, and the bounds."""

    running: int
    target: int
    lowest: int
    highest: int


@dataclass(frozen=True)
class Decision:
    replicas: int
    state: dict[str, Any]
    reason: str


_STATE_KEYS = ("hot_since", "cool_since", "settle_until", "changing", "last_target", "hot_load")


def decide(p: Params, s: Signals, r: Replicas, target_ongoing: float | None,
           state: Mapping[str, Any], now: float) -> Decision:
    """The replicas wanted now. ``state`` is what the previous call returned (empty at first);
    only the policy's own keys are read, so Ray's keys beside them do no harm."""
    st: dict[str, Any] = {k: state.get(k) for k in _STATE_KEYS}
    target = min(max(r.target, r.lowest), r.highest)
    if target != r.target:
        return _done(st, target, target, f"bounds {r.lowest}..{r.highest}")
    # A change under way, or made since the last call: wait for it, then for a window of signals.
    if r.running != r.target or st["last_target"] not in (None, r.target):
        st.update(hot_since=None, cool_since=None, changing=True)
        return _done(st, target, target, "replicas changing")
    if st["changing"]:
        st.update(changing=False, settle_until=now + p.window_s)
    if st["settle_until"] is not None and now < st["settle_until"]:
        return _done(st, target, target, "settling")

    obj = p.objective_s
    load_need = math.ceil(s.ongoing / target_ongoing) if target_ongoing else 0
    hot: list[str] = []
    if obj is not None and s.ttft_s is not None and s.ttft_s >= p.up_at * obj:
        hot.append(f"TTFT p95 {s.ttft_s:.3f} s >= {p.up_at:g} x objective {obj:g} s")
    if obj is not None and s.wait_s is not None and s.wait_s >= p.wait_up_at * obj:
        hot.append(f"wait p95 {s.wait_s:.3f} s >= {p.wait_up_at:g} x objective {obj:g} s")
    elif (obj is not None and s.wait_s is not None and s.wait_rising
          and s.wait_s >= p.wait_up_at * obj / 2):
        hot.append(f"wait p95 {s.wait_s:.3f} s rising")
    if load_need > target:
        hot.append(f"{s.ongoing:.1f} ongoing requests > {target_ongoing:g} per replica")
    if hot:
        st["cool_since"] = None
        if target >= r.highest:
            st["hot_since"] = None
            return _done(st, target, target, "hot at max_replicas: " + "; ".join(hot))
        st["hot_since"] = now if st["hot_since"] is None else st["hot_since"]
        if now - st["hot_since"] < p.upscale_delay_s:
            return _done(st, target, target, "hot, holding: " + "; ".join(hot))
        st.update(hot_since=None, hot_load=s.ongoing / target)
        return _done(st, target, min(r.highest, max(target + 1, load_need)), "; ".join(hot))

    st["hot_since"] = None
    fewer = target - 1
    if fewer < r.lowest:
        st["cool_since"] = None
        return _done(st, target, target, "steady")
    calm = obj is None or all(v is None or v < p.down_at * obj for v in (s.ttft_s, s.wait_s))
    if fewer == 0:
        fits = s.ongoing == 0
    else:
        per = s.ongoing / fewer
        fits = ((not target_ongoing or per <= target_ongoing)
                and (st["hot_load"] is None or per <= st["hot_load"] * p.down_at / p.up_at))
    if not (calm and fits):
        st["cool_since"] = None
        return _done(st, target, target, "steady")
    st["cool_since"] = now if st["cool_since"] is None else st["cool_since"]
    if now - st["cool_since"] < p.downscale_delay_s:
        return _done(st, target, target, "cool, holding")
    st["cool_since"] = None
    return _done(st, target, fewer, f"cool for {p.downscale_delay_s:g} s: TTFT p95 "
                 f"{_seconds(s.ttft_s)}, wait p95 {_seconds(s.wait_s)}, {s.ongoing:.1f} ongoing")


def _done(st: dict[str, Any], target: int, replicas: int, reason: str) -> Decision:
    st["last_target"] = replicas
    if replicas != target:  # settle once the replicas follow, however fast they do
        st["changing"] = True
    return Decision(replicas, st, reason)


def _seconds(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f} s"


def signals_from(raw: Mapping[str, Mapping[Any, Any]] | None, ongoing: float, min_samples: int,
                 now: float, max_age_s: float) -> Signals:
    """``Signals`` from the raw custom metrics of an ``AutoscalingContext`` (metric -> replica ->
    time series of ``TimeStampedValue``): each replica's latest report no older than ``max_age_s``.
    Ongoing requests are the larger of ``ongoing`` (Ray Serve's count) and the sum of the
    replicas' own counts (``ONGOING_METRIC``, averaged over each replica's fresh reports)."""
    raw = raw or {}
    reported = 0.0
    for series in (raw.get(ONGOING_METRIC) or {}).values():
        fresh = _fresh(series, now, max_age_s)
        if fresh:
            reported += sum(fresh) / len(fresh)
    ongoing = max(ongoing, reported)
    ttfts: list[float] = []
    waits: list[float] = []
    rising = False
    for replica, series in (raw.get(COUNT_METRIC) or {}).items():
        count = _latest(series, now, max_age_s)
        if count is None or count < min_samples:
            continue
        ttft = _latest((raw.get(TTFT_METRIC) or {}).get(replica), now, max_age_s)
        if ttft is not None:
            ttfts.append(ttft)
        wait_series = _fresh((raw.get(WAIT_METRIC) or {}).get(replica), now, max_age_s)
        if wait_series:
            waits.append(wait_series[-1])
            last = wait_series[-RISING_SAMPLES - 1:]
            rising = rising or (len(last) > RISING_SAMPLES
                                and all(a < b for a, b in zip(last, last[1:], strict=False)))
    return Signals(ttft_s=max(ttfts, default=None), wait_s=max(waits, default=None),
                   wait_rising=rising, ongoing=ongoing)


def _fresh(series: Iterable[Any] | None, now: float, max_age_s: float) -> list[float]:
    points = sorted((float(v.timestamp), float(v.value)) for v in series or ()
                    if now - float(v.timestamp) <= max_age_s)
    return [v for _, v in points]


def _latest(series: Iterable[Any] | None, now: float, max_age_s: float) -> float | None:
    fresh = _fresh(series, now, max_age_s)
    return fresh[-1] if fresh else None


class ObjectivePolicy:
    """Ray Serve's custom autoscaling policy (``policy_function``; Ray instantiates the class once
    with ``policy_kwargs``, the fields of ``Params``, and calls it on every control-loop tick)."""

    def __init__(self, **kwargs: Any) -> None:
        self.params = Params(**kwargs)

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        now = ctx.current_time or time.time()
        cfg = ctx.config
        assert cfg is not None  # Ray always passes the deployment's AutoscalingConfig
        signals = signals_from(ctx.raw_metrics, float(ctx.total_num_requests),
                               self.params.min_samples, now, cfg.look_back_period_s)
        d = decide(self.params, signals,
                   Replicas(ctx.current_num_replicas, ctx.target_num_replicas,
                            ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas),
                   cfg.get_target_ongoing_requests(), ctx.policy_state, now)
        if d.replicas != ctx.target_num_replicas:
            logger.info("autoscale %s: %d -> %d replicas: %s", ctx.deployment_name,
                        ctx.target_num_replicas, d.replicas, d.reason)
        # Ray keeps its own keys in the same dict; hand them back untouched.
        return d.replicas, {**ctx.policy_state, **d.state}


# ---- in build_app: Ray Serve's options --------------------------------------------------------
def top_tier_objective_s(cfg: AppConfig) -> float:
    """The TTFT objective of the top-priority tier, in seconds (the tightest, if several share it)."""
    top = cfg.top_priority
    return min(t.objectives.ttft_p95_ms for t in cfg.tiers.values() if t.priority == top) / 1000


def autoscaling_options(a: AutoscalingConfig, objective_s: float | None) -> dict[str, Any]:
    """Ray Serve's ``autoscaling_config`` for ``a``, always with ``ObjectivePolicy``, which owns
    the delays (Ray's are set to 0): Ray Serve's default policy counts only the requests that
    cross its handles, and the gateway's requests go to the replicas' endpoints. Without
    ``objective_policy`` the policy scales on ongoing requests alone (Ray's default rule, on the
    replicas' own counts); with it, also on the top tier's TTFT and wait against ``objective_s``."""
    opts = a.model_dump(exclude_none=True, exclude={"objective_policy"})
    o = a.objective_policy
    if o is None:
        params = Params(objective_s=None, upscale_delay_s=a.upscale_delay_s,
                        downscale_delay_s=a.downscale_delay_s)
    else:
        if objective_s is None:
            raise ValueError("objective_policy needs the top tier's TTFT objective")
        params = Params(objective_s=objective_s, up_at=o.up_at, wait_up_at=o.wait_up_at,
                        down_at=o.down_at, window_s=o.window_s, min_samples=o.min_samples,
                        upscale_delay_s=a.upscale_delay_s, downscale_delay_s=a.downscale_delay_s)
    opts.update(upscale_delay_s=0.0, downscale_delay_s=0.0,
                policy={"policy_function": POLICY_PATH, "policy_kwargs": asdict(params)})
    return opts
