"""serve_app.engine.autoscale: the objective policy, driven with fake contexts and a fake clock.

The policy is a pure function of the replicas' reports, the replica counts, its state and the time,
so a noisy series can be replayed tick by tick. ``tick`` goes through ``ObjectivePolicy`` and Ray
Serve's own wrapper (``_apply_autoscaling_config``, what the controller calls), with a real
``AutoscalingContext``, so what Ray adds (its delays, set to 0 here) is part of what is tested.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import ValidationError
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig as RayAutoscalingConfig
from ray.serve.config import AutoscalingContext

from serve_app.app import build_app, model_deployment_options
from serve_app.config import AutoscalingConfig
from serve_app.engine.autoscale import (
    COUNT_METRIC,
    ONGOING_METRIC,
    POLICY_PATH,
    TTFT_METRIC,
    WAIT_METRIC,
    ObjectivePolicy,
    Params,
    Replicas,
    Signals,
    TopTierWindow,
    autoscaling_options,
    decide,
    p95,
    signals_from,
    top_tier_objective_s,
)
from serve_app.protocol import RequestContext
from tests.unit.builders import app_config, model, model_doc, tier

OBJECTIVE_S = 1.0
DEP = DeploymentID(name="model-m", app_name="llm")


def _params(**over: Any) -> Params:
    return Params(**{"objective_s": OBJECTIVE_S, "window_s": 10.0, "min_samples": 5,
                     "upscale_delay_s": 5.0, "downscale_delay_s": 60.0, **over})


@dataclass
class Deployment:
    """A deployment as the controller sees it: running replicas, Ray's target, each replica's
    reports, and the policy wrapped as Ray wraps it. ``tick`` is one control-loop call."""

    params: Params
    lowest: int = 1
    highest: int = 3
    running: int = 1
    target: int = 1
    target_ongoing: float = 16.0
    now: float = 1000.0
    state: dict[str, Any] = field(default_factory=dict)
    reports: dict[str, dict[ReplicaID, list[TimeStampedValue]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        opts = autoscaling_options(AutoscalingConfig(
            min_replicas=self.lowest, max_replicas=self.highest,
            target_ongoing_requests=self.target_ongoing, look_back_period_s=30,
            upscale_delay_s=self.params.upscale_delay_s,
            downscale_delay_s=self.params.downscale_delay_s,
            objective_policy=None if self.params.objective_s is None else {  # type: ignore[arg-type]
                "window_s": self.params.window_s, "min_samples": self.params.min_samples},
        ), self.params.objective_s)
        self.config = RayAutoscalingConfig(**opts)
        # As the controller does: the pickled class, instantiated with its kwargs, then wrapped.
        self.policy = _apply_autoscaling_config(_resolve_policy_callable(self.config.policy))

    def report(self, ttft: float, wait: float = 0.0, count: int = 20) -> None:
        """Every running replica reports these p95s now."""
        for i in range(self.running):
            rid = ReplicaID(unique_id=f"r{i}", deployment_id=DEP)
            for name, value in ((TTFT_METRIC, ttft), (WAIT_METRIC, wait), (COUNT_METRIC, count)):
                self.reports.setdefault(name, {}).setdefault(rid, []).append(
                    TimeStampedValue(self.now, float(value)))

    def tick(self, ongoing: float = 1.0, dt: float = 1.0) -> int:
        """Advance the clock by ``dt``, call the policy; the controller applies its answer as the
        new target at once (the replicas follow with ``settle``)."""
        self.now += dt
        ctx = AutoscalingContext(
            deployment_id=DEP, deployment_name=DEP.name, app_name=DEP.app_name,
            current_num_replicas=self.running, target_num_replicas=self.target,
            running_replicas=[ReplicaID(unique_id=f"r{i}", deployment_id=DEP)
                              for i in range(self.running)],
            total_num_requests=ongoing, total_queued_requests=0.0, aggregated_metrics={},
            raw_metrics={k: {r: v for r, v in per.items() if int(r.unique_id[1:]) < self.running}
                         for k, per in self.reports.items()},
            capacity_adjusted_min_replicas=self.lowest, capacity_adjusted_max_replicas=self.highest,
            policy_state=self.state, last_scale_up_time=None, last_scale_down_time=None,
            current_time=self.now, config=self.config,
        )
        wanted, self.state = self.policy(ctx)
        self.target = min(max(wanted, self.lowest), self.highest)  # the controller's bounds
        return self.target

    def settle(self) -> None:
        """The replicas reach the target (started or stopped)."""
        self.running = self.target


def run(d: Deployment, seconds: float, ttft: float, wait: float = 0.0, ongoing: float = 1.0,
        follow: bool = True) -> list[int]:
    """Report and tick once a second for ``seconds``; the targets seen. With ``follow``, replicas
    reach each new target by the next tick."""
    seen = []
    for _ in range(int(seconds)):
        d.report(ttft, wait)
        seen.append(d.tick(ongoing))
        if follow:
            d.settle()
    return seen


# ---- scaling up -------------------------------------------------------------------------------
def test_premium_p95_at_80_percent_of_the_objective_adds_a_replica_after_the_upscale_hold() -> None:
    d = Deployment(_params())
    assert run(d, 30, ttft=0.5) == [1] * 30  # well within the objective: nothing
    seen = run(d, 10, ttft=0.8, follow=False)
    # Hot from the first tick; the hold is 5 s, so the sixth tick asks for a second replica.
    assert seen[:5] == [1] * 5 and seen[5] == 2
    assert "autoscale" not in d.state  # no stray keys: only the policy's and Ray's own


def test_a_growing_wait_at_the_gateway_adds_a_replica_before_ttft_misses() -> None:
    d = Deployment(_params())
    run(d, 15, ttft=0.3)
    assert run(d, 6, ttft=0.55, wait=0.5)[-1] == 2  # wait p95 at half the objective


def test_a_wait_that_keeps_rising_adds_a_replica() -> None:
    d = Deployment(_params())
    run(d, 15, ttft=0.3, wait=0.1)
    seen = []
    for i in range(10):  # rising every report, past a quarter of the objective
        d.report(ttft=0.45, wait=0.26 + 0.01 * i)
        seen.append(d.tick())
    assert 2 in seen
    # A wait as high that does not rise changes nothing.
    flat = Deployment(_params())
    assert run(flat, 20, ttft=0.45, wait=0.3) == [1] * 20


def test_ongoing_requests_still_add_replicas_as_ray_serves_policy_does() -> None:
    d = Deployment(_params())
    assert run(d, 10, ttft=0.2, ongoing=40.0)[-1] == 3  # 40 / 16 per replica: 3 at once


def test_a_few_slow_requests_are_not_a_p95() -> None:
    d = Deployment(_params())
    for _ in range(20):
        d.report(ttft=5.0, count=3)  # under min_samples
        d.tick()
    assert d.target == 1


def test_nothing_more_while_the_new_replica_starts_nor_until_its_window_is_full() -> None:
    d = Deployment(_params())
    seen = run(d, 8, ttft=0.9, follow=False)
    assert seen[-1] == 2 and d.running == 1
    # The replica takes 40 s to start; the p95 stays hot meanwhile: no third replica.
    assert run(d, 40, ttft=0.9, follow=False) == [2] * 40
    d.settle()
    # Running; the old replica's window still holds the hot samples for window_s (10 s).
    assert run(d, 9, ttft=0.9) == [2] * 9
    # Still hot after the window: the third replica, after the 5 s hold.
    assert run(d, 7, ttft=0.9)[-1] == 3


# ---- scaling down ------------------------------------------------------------------------------
def _scaled_to_two(**over: Any) -> Deployment:
    d = Deployment(_params(**over))
    run(d, 8, ttft=0.9, ongoing=8.0)
    assert d.target == 2 and d.running == 2
    return d


def test_scale_down_only_after_the_downscale_hold_of_calm() -> None:
    d = _scaled_to_two()
    seen = run(d, 120, ttft=0.1, ongoing=1.0)
    first_down = seen.index(1)
    # 10 s settling from the scale-up (2 s of it in _scaled_to_two), then 60 s of calm.
    assert first_down == 8 + 60
    assert seen[first_down:] == [1] * (120 - first_down)


def test_the_load_that_needed_two_replicas_does_not_get_one() -> None:
    # After the scale-up, TTFT is fine at 2 replicas but the load (8 requests, hot at 8 per replica
    # on one) would not fit one replica below down_at / up_at of it: the policy keeps 2.
    d = _scaled_to_two()
    assert run(d, 300, ttft=0.1, ongoing=8.0) == [2] * 300
    # Half that load fits: down after the hold.
    assert run(d, 80, ttft=0.1, ongoing=4.0)[-1] == 1


def test_a_single_warm_tick_restarts_the_downscale_hold() -> None:
    d = _scaled_to_two()
    run(d, 50, ttft=0.1)  # settling, then 40 s of calm
    run(d, 1, ttft=0.6)  # above down_at (0.5): not calm
    seen = run(d, 59, ttft=0.1)
    assert seen == [2] * 59  # 59 s of calm since: not yet
    assert run(d, 2, ttft=0.1)[-1] == 1


def test_no_flapping_across_a_noisy_series() -> None:
    # A p95 that wanders between down_at and up_at, with single spikes past up_at and dips under
    # down_at, and a load around the one that made it hot: the replica count never moves.
    rng = random.Random(7)
    d = _scaled_to_two()
    seen = []
    for i in range(1800):  # 30 minutes, one tick a second
        v = rng.uniform(0.5, 0.78)
        if i % 37 == 0:
            v = 0.95  # one hot report (shorter than the 5 s upscale hold)
        if i % 53 == 0:
            v = 0.2  # one calm report (shorter than the 60 s downscale hold)
        d.report(ttft=v)
        seen.append(d.tick(ongoing=rng.uniform(6.0, 9.0)))
        d.settle()
    assert seen == [2] * 1800


def test_after_a_load_step_one_up_one_down_and_then_nothing() -> None:
    # A step of 8 requests that one replica serves at TTFT 0.85-1.1 s and two at 0.1-0.4 s, for
    # two minutes; then 10 minutes of a trickle.
    d = Deployment(_params())
    rng = random.Random(11)
    seen = run(d, 30, ttft=0.2)
    for _ in range(120):
        hot = d.running == 1
        seen += run(d, 1, ttft=rng.uniform(0.85, 1.1) if hot else rng.uniform(0.1, 0.4), ongoing=8.0)
    seen += [x for _ in range(600) for x in run(d, 1, ttft=rng.uniform(0.05, 0.3), ongoing=1.0)]
    changes = [b for a, b in zip(seen, seen[1:], strict=False) if a != b]
    assert changes == [2, 1]


# ---- bounds -------------------------------------------------------------------------------------
def test_never_above_max_replicas() -> None:
    d = Deployment(_params(), highest=2)
    assert max(run(d, 200, ttft=3.0, ongoing=100.0)) == 2


def test_never_below_min_replicas() -> None:
    d = Deployment(_params(), lowest=2, running=2, target=2)
    assert min(run(d, 300, ttft=0.0, ongoing=0.0)) == 2


def test_a_target_outside_new_bounds_is_brought_back() -> None:
    d = Deployment(_params(), lowest=1, highest=2, running=3, target=3)
    assert d.tick() == 2


def test_scale_to_zero_only_without_requests() -> None:
    d = Deployment(_params(), lowest=0)
    assert run(d, 120, ttft=0.1, ongoing=0.5) == [1] * 120
    assert run(d, 70, ttft=0.1, ongoing=0.0)[-1] == 0


# ---- the pure function ---------------------------------------------------------------------------
def test_decide_is_a_function_of_its_inputs() -> None:
    p = _params(upscale_delay_s=0.0)
    r = Replicas(running=1, target=1, lowest=1, highest=4)
    hot = Signals(ttft_s=0.8, wait_s=0.1, ongoing=3.0)
    a = decide(p, hot, r, 16.0, {}, now=50.0)
    b = decide(p, hot, r, 16.0, {}, now=50.0)
    assert a == b and a.replicas == 2
    assert "TTFT p95 0.800 s >= 0.8 x objective 1 s" in a.reason
    assert decide(p, Signals(ttft_s=None, ongoing=3.0), r, 16.0, {}, now=50.0).replicas == 1


# ---- the replica's window ------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _ctx(priority: int, arrival: float) -> RequestContext:
    return RequestContext(request_id="r", key_id="k", tier="t", priority=priority, arrival=arrival)


def test_window_measures_the_top_tier_streams_from_the_front_door_arrival() -> None:
    clock = Clock()
    w = TopTierWindow(top_priority=0, window_s=10.0, clock=clock)
    for i in range(20):
        tok = w.begin(_ctx(0, arrival=clock.t - 0.2), stream=True, start=clock.t)
        w.first(tok, clock.t + 0.1 * (i + 1) / 20, ok=True)
        w.end(tok)
    assert w.begin(_ctx(5, arrival=clock.t), stream=True, start=clock.t) is None  # other tier
    assert w.begin(_ctx(0, arrival=clock.t), stream=False, start=clock.t) is None  # no TTFT
    err = w.begin(_ctx(0, arrival=clock.t - 9), stream=True, start=clock.t)
    w.first(err, clock.t, ok=False)  # an error head is no TTFT
    s = w.stats()
    assert s[COUNT_METRIC] == 20
    assert s[TTFT_METRIC] == pytest.approx(0.2 + 0.1 * 19 / 20)
    assert s[WAIT_METRIC] == pytest.approx(0.2)
    clock.t += 10.5
    assert w.stats()[COUNT_METRIC] == 0  # out of the window


def test_window_counts_streams_still_waiting_with_their_age() -> None:
    clock = Clock()
    w = TopTierWindow(top_priority=0, window_s=10.0, clock=clock)
    tok = w.begin(_ctx(0, arrival=clock.t - 1.0), stream=True, start=clock.t - 0.5)
    clock.t += 2.0
    s = w.stats()
    assert (s[COUNT_METRIC], s[TTFT_METRIC], s[WAIT_METRIC]) == (1, 3.0, 0.5)
    w.end(tok)  # cancelled before its head
    assert w.stats()[COUNT_METRIC] == 0


def test_p95_is_nearest_rank() -> None:
    assert p95([]) == 0.0
    assert p95(range(1, 101)) == 95
    assert p95([3.0]) == 3.0


# ---- config and wiring ---------------------------------------------------------------------------
def test_default_autoscaling_scales_on_the_replicas_own_ongoing_counts() -> None:
    """Ray Serve's default policy counts only requests that cross its handles, and the gateway's
    go to the replicas' endpoints: every autoscaled model gets the policy, without an objective."""
    opts = autoscaling_options(AutoscalingConfig(max_replicas=2, upscale_delay_s=7), None)
    assert "objective_policy" not in opts
    assert (opts["upscale_delay_s"], opts["downscale_delay_s"]) == (0.0, 0.0)
    kw = opts["policy"]["policy_kwargs"]
    assert kw["objective_s"] is None and kw["upscale_delay_s"] == 7
    assert not RayAutoscalingConfig(**opts).policy.is_default_policy_function()


def test_the_replicas_own_counts_drive_scaling_when_ray_sees_none() -> None:
    """1 -> 3 on 40 requests the replicas report (Ray Serve's own count is 0), then back to 1
    once they end, after the downscale hold."""
    d = Deployment(Params(objective_s=None, window_s=5, upscale_delay_s=3, downscale_delay_s=20))

    def tick_with(per_replica: float) -> int:
        for i in range(d.running):
            rid = ReplicaID(unique_id=f"r{i}", deployment_id=DEP)
            d.reports.setdefault(ONGOING_METRIC, {}).setdefault(rid, []).append(
                TimeStampedValue(d.now + 1, per_replica))
        seen = d.tick(ongoing=0.0)
        d.settle()
        return seen

    assert [tick_with(40.0) for _ in range(5)][-1] == 3  # 40 / 16 per replica
    for _ in range(40):  # the old reports age out of the 30 s look-back
        tick_with(0.0)
    assert [tick_with(0.0) for _ in range(150)][-1] == 1
    assert signals_from({ONGOING_METRIC: {"a": [TimeStampedValue(d.now, 4.0)],
                                          "b": [TimeStampedValue(d.now, 6.0)]}},
                        1.0, 10, d.now, 30).ongoing == 10.0


def test_objective_policy_owns_the_delays_and_gets_the_objective() -> None:
    m = model(deployment={"autoscaling_config": {
        "max_replicas": 4, "upscale_delay_s": 10, "downscale_delay_s": 300,
        "objective_policy": {"up_at": 0.7, "down_at": 0.3, "window_s": 20}}})
    opts = model_deployment_options(m, 0.3)["autoscaling_config"]
    assert (opts["upscale_delay_s"], opts["downscale_delay_s"]) == (0.0, 0.0)
    assert opts["policy"]["policy_function"] == POLICY_PATH
    kw = opts["policy"]["policy_kwargs"]
    assert (kw["objective_s"], kw["up_at"], kw["down_at"], kw["window_s"]) == (0.3, 0.7, 0.3, 20.0)
    assert (kw["upscale_delay_s"], kw["downscale_delay_s"]) == (10.0, 300.0)
    policy = _resolve_policy_callable(RayAutoscalingConfig(**opts).policy)
    assert isinstance(policy, ObjectivePolicy) or type(policy).__name__ == "ObjectivePolicy"


def test_objective_policy_needs_the_objective() -> None:
    a = AutoscalingConfig(objective_policy={})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top tier's TTFT objective"):
        autoscaling_options(a, None)


@pytest.mark.parametrize(("over", "msg"), [
    ({"down_at": 0.8, "up_at": 0.8}, "down_at (0.8) must be < up_at (0.8)"),
    ({"up_at": 1.5}, "up_at"),
    ({"window_s": 0}, "window_s"),
    ({"min_samples": 0}, "min_samples"),
    ({"typo": 1}, "typo"),
])
def test_objective_policy_config_is_validated(over: dict[str, Any], msg: str) -> None:
    with pytest.raises(ValidationError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        AutoscalingConfig(objective_policy=over)  # type: ignore[arg-type]


def test_top_tier_objective_is_the_tightest_of_the_top_priority() -> None:
    cfg = app_config(default_tier="b", tiers={
        "a": tier(0, objectives={"ttft_p95_ms": 800}),
        "a2": tier(0, objectives={"ttft_p95_ms": 500}),
        "b": tier(5, objectives={"ttft_p95_ms": 100}),
    })
    assert top_tier_objective_s(cfg) == 0.5


def test_build_app_passes_the_top_tier_objective() -> None:
    from ray.serve._private.build_app import build_app as ray_build_app

    cfg = app_config(
        model_doc(deployment={"autoscaling_config": {"max_replicas": 2, "objective_policy": {}}}),
        default_tier="p", tiers={"p": tier(0, objectives={"ttft_p95_ms": 400})},
    )
    built = ray_build_app(build_app(cfg), name="llm")
    model = next(dep for dep in built.deployments if dep.name == "model-m")
    auto = model._deployment_config.autoscaling_config
    assert auto is not None and auto.policy.policy_kwargs["objective_s"] == 0.4
