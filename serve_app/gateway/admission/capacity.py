"""Capacity: how many requests each model has in flight here, its bounds, and who is shed.

A model has room for a key when its in-flight requests (this replica's count, scaled to all
gateway replicas) are below both its capacity (``max_ongoing_requests`` x running replicas +
``max_queued_requests``; 503 for every tier) and its tier's share of ``saturation_requests`` (503
for that tier). ``saturation_requests`` is given for the model at its largest (``max_replicas``),
and both bounds follow the replicas running now (``replicas.LiveReplicas``), so that an
autoscaled model running one replica sheds batch at the right point and grows its bounds when it
scales up. A model with no running replica (starting, being replaced, its node lost) is bounded as
if one ran, and a candidate with a running replica goes first: the request then waits in Ray
Serve's queue (which also asks the autoscaler for a replica), and the forwarder's outage guard
(``outage.py``) answers 503 once it has waited ``gateway.http.unavailable_hold_s`` for a model still
down: the one hold. The gateway enforces the capacity
itself: Ray Serve's ``max_queued_requests`` is counted per caller and only for requests waiting to
be routed, so a burst can pass it. The slot is taken in the same step as the check, with no
``await`` between, so a burst cannot pass it here.

A model with a flow queue (``flow``) counts its slots here too, and applies both bounds to
everything it holds, waiting requests included (``refusal``); its own in-flight bound starts from
``engine_slots``.
"""

from __future__ import annotations

from collections import defaultdict

from serve_app import errors
from serve_app.config import AppConfig, TierConfig
from serve_app.gateway.routing.replicas import LiveReplicas


class Capacity:
    """In-flight counts and bounds of the models, for one gateway replica."""

    def __init__(self, cfg: AppConfig, replicas: LiveReplicas | None = None) -> None:
        self.cfg = cfg
        self.replicas = replicas
        self.inflight: dict[str, int] = defaultdict(int)
        self._models = {m.id: m for m in cfg.models}

    def running(self, model_id: str) -> int:
        """Replicas of the model running now, or its configured count while that is unknown."""
        live = self.replicas.running(model_id) if self.replicas is not None else None
        if live is not None:
            return live
        m = self._models.get(model_id)
        return m.deployment.most_replicas if m is not None else 1

    def bounds(self, model_id: str) -> tuple[int | None, float | None]:
        """(capacity, saturation) of the model for the replicas running now; None: unbounded."""
        m = self._models.get(model_id)
        if m is None:
            return None, None
        running = max(1, self.running(model_id))  # none running: the bounds of the first to come
        capacity = m.deployment.capacity_with(running)
        sat = m.admission.saturation_requests
        most = m.deployment.most_replicas
        saturation = None if sat is None else sat * min(running, most) / most
        return capacity, saturation

    def release(self, model_id: str) -> None:
        self.inflight[model_id] -= 1

    def engine_slots(self, model_id: str) -> int:
        """Requests one model replica runs at once, for the flow queue's bound
        (``flow.max_inflight_per_replica``, else ``engine.max_num_seqs``, else the deployment's
        ``max_ongoing_requests``)."""
        m = self._models[model_id]
        return (m.flow.max_inflight_per_replica or m.engine.max_num_seqs
                or m.deployment.max_ongoing_requests)

    def ready_slots(self, model_id: str) -> int:
        """Requests per model replica the flow queue sends past ``engine_slots`` to wait, ready, in
        the replica's slot gate (``flow.ready_per_replica``, else an eighth of the slots), at most
        what the replica takes beyond them (``max_ongoing_requests``): past that they would wait in
        Ray Serve's router, not ready in the replica."""
        m = self._models[model_id]
        slots = self.engine_slots(model_id)
        ready = slots // 8 if m.flow.ready_per_replica is None else m.flow.ready_per_replica
        return max(0, min(ready, m.deployment.max_ongoing_requests - slots))

    def lower_slots(self, model_id: str) -> int:
        """Of ``engine_slots``, the ones a request below the top tier may take: the engine's
        ``admission.reserved_slots`` stay for the top tier (the replica's ``SlotGate`` keeps
        them, so a lower-tier request the gateway sent past them would only wait there, ahead of
        premium's requests still at the gateway)."""
        m = self._models[model_id]
        return max(1, self.engine_slots(model_id) - m.admission.reserved_slots)

    def refusal(self, model_id: str, tier_name: str, tier: TierConfig,
                waiting: int = 0) -> errors.ServiceUnavailable | None:
        """Why a request of ``tier`` may not be held for the model now, or None. ``waiting``: the
        requests this replica holds in its flow queue for the model, counted like those in flight
        (the flow queue applies ``shed_at`` and the capacity to everything it holds)."""
        return self._refusal(model_id, tier_name, tier, waiting)

    def _refusal(self, model_id: str, tier_name: str, tier: TierConfig,
                 waiting: int = 0) -> errors.ServiceUnavailable | None:
        # Each gateway replica sees its share of the traffic; scale its count to the whole.
        load = (self.inflight[model_id] + waiting) * self.cfg.gateway.num_replicas
        retry = self.cfg.gateway.http.retry_after_s
        capacity, saturation = self.bounds(model_id)
        if capacity is not None and load >= capacity:
            return errors.Overloaded(
                f"model {model_id!r} is at capacity ({capacity} requests running or queued). "
                "Retry shortly.",
                retry_after_s=retry,
            )
        if saturation is not None and tier.shed_at < 1.0 and load >= tier.shed_at * saturation:
            return errors.Shed(
                f"model {model_id!r} is saturated; tier {tier_name!r} is shed first. Retry shortly.",
                retry_after_s=retry,
            )
        return None
