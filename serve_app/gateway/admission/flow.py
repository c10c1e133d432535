"""Flow control: a queue per model at the gateway, by tier band, fair between tenants.

A model with ``flow.enabled`` gets a request only while its requests in flight are under a bound
(``Flow.limit``); otherwise the request waits here, where the gateway decides who goes next,
instead of in the engine, where every admitted request's prefill competes with premium's first
token.

- **The bound.** Per running model replica: ``flow.max_inflight_per_replica``, else the engine's
  ``max_num_seqs``, else the deployment's ``max_ongoing_requests``; times the replicas running now
  (``replicas.LiveReplicas``). With ``flow.adaptive`` the per-replica bound moves between
  ``flow.min_inflight_per_replica`` (default: a quarter of the ceiling) and that ceiling (AIMD): each finished top-tier request's
  engine-side time to first token (its ``handle`` and ``engine`` stages) is compared with
  ``flow.target_share`` of the top tier's TTFT objective; when more than ``TOP_SLOW_SHARE`` of
  the top tier's last ``TOP_WINDOW`` answers were over it (its p95 is, as the objective is a p95),
  the bound is cut by a fifth (at most once per target interval, so one burst of slow answers is
  one cut); a fast answer, while requests wait, grows it by 1/bound (one slot per bound's worth
  of good answers). A top-tier
  request that waited here for a slot longer than ``TOP_WAIT_CUT`` of its objective cuts it too:
  the lower bands hold slots the top tier needed (without this, at 4x the base load premium
  waited for batch streams to end and 10-14 of ~1,300 premium requests got 503). Only the top
  tier's slow answers cut: the bound is there to keep its objective, and the lower tiers' first
  tokens are slow by design under the engine's priority scheduling (a first run that counted every
  tier cut the bound far down, and premium then queued behind its own traffic); any tier's fast
  answer grows it, and once no top-tier request has come for ``TOP_QUIET_OBJECTIVES`` of its
  objective it is back at its ceiling. The gateway's own wait
  is not part of the signal, or a cut would feed on itself.
- **The top band is held only by the ceiling.** The adaptive bound keeps the lower bands out of
  the engine; the top tier's requests go in while the model's requests in flight are under the
  ceiling (``Flow.top_limit``), since inside the engine its priority scheduler runs them first.
  Holding the top tier behind a bound cut for its own sake only turns engine time into gateway
  wait and 503s (the first benchmark at 4x the base load: 242 premium 503s, a third of the
  throughput, with the bound at its floor).
- **The reserve is the top tier's.** The lower bands' ceiling leaves the engine's
  ``admission.reserved_slots`` free (``Capacity.lower_slots``). Before, the lower bands could
  fill every ``max_num_seqs`` slot: the replica's slot gate kept the reserve for a premium request
  that the gateway was holding back at the ceiling, and premium waited for a batch stream to end
  (14 premium 503s at 4x in docs/perf/flow-20261205-062007).
- **Ready requests.** ``flow.ready_per_replica`` (default: an eighth of the engine's slots) more
  requests per model replica than the ceiling may be in flight: they wait in the replica's slot
  gate (in priority order, the reserve kept), tokenized, and take a freed engine slot at once.
  Without them a freed slot stays idle until the gateway learns of the end and sends the next
  request through the whole path (the flow bench before them: throughput with the queue 0.90-0.92x
  without it). A bound the adaptive control has cut gets none: it is there to keep the engine's
  batch small.
- **Several gateway replicas.** Each replica queues its own requests and gets
  ``max(1, bound // gateway.num_replicas)`` of the bound, so together they never pass it (when
  the bound is at least the replica count); the cost is that one replica's waiters do not use
  another's idle share (Ray Serve spreads requests over the gateway replicas, so the shares stay
  close). Tested in ``tests/unit/test_flow.py``.
- **Order.** Strictly by tier band (``TierConfig.priority``, lowest first); within a band, deficit
  round-robin between tenants (``KeyRecord.tenant_id``) weighted by each request's token
  reservation (prompt estimate plus completion bound), ``flow.quantum_tokens`` per turn: a tenant
  with 32 requests waiting gets the same tokens per round as one with 2. A tenant with nothing
  waiting that sends a request has the next turn (FQ-CoDel's new flows), so a sparse tenant does not
  wait behind a busy one's quantum.
- **Bounds.** A request waits at most its tier's ``queue_wait_s`` and then gets 503 with
  Retry-After. Before it joins, the capacity (``max_ongoing_requests`` x replicas +
  ``max_queued_requests``) and the tier's ``shed_at`` share of ``saturation_requests`` are checked
  against everything the model holds (in flight and waiting): shedding is this queue's admission
  policy, not a second mechanism; ``flow.max_waiting`` bounds the queue itself.
- **Cancellation.** A request that leaves while waiting (timeout, client gone, a failed limit
  charge) is taken out of its queue; if a slot was granted to it meanwhile, the slot is released
  (and goes to the next waiter). Nothing else is held by a waiter.

A model without ``flow.enabled`` is admitted by its capacity and ``shed_at`` only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from serve_app import errors
from serve_app.config import AppConfig, TierConfig
from serve_app.gateway.admission.capacity import Capacity

logger = logging.getLogger("ray.serve")

DECREASE = 0.8  # the bound's cut when the engine's time to first token is over target
# A top-tier request that waited at the gateway longer than this share of its TTFT objective cuts
# the lower bands' bound, as a slow engine-side first token does.
TOP_WAIT_CUT = 0.05
# The cuts are for the top tier: once none of its requests has come for this many of its TTFT
# objectives, the lower bands' bound is back at its ceiling.
TOP_QUIET_OBJECTIVES = 5
# The objective is a p95: the bound is cut when more than this share of the top tier's last
# TOP_WINDOW answers had a slow engine-side first token, not at each slow one.
TOP_WINDOW = 20
TOP_SLOW_SHARE = 0.05


class FlowSink(Protocol):
    """Where the queue's depth, waits and bound go (``serve_app.metrics.FlowMetrics``)."""

    def queue_depth(self, *, model: str, tier: str, tenant: str, depth: int) -> None: ...
    def queue_waited(self, *, model: str, tier: str, tenant: str, seconds: float,
                     outcome: str) -> None: ...
    def inflight_bound(self, *, model: str, bound: int) -> None: ...


@dataclass(eq=False)
class Waiter:
    """One request's place in a queue, or its slot. ``state``: waiting, granted (holds a slot of
    ``model_id``), expired (timed out in the queue) or withdrawn (left before a slot)."""

    model_id: str
    tier: str
    band: int
    tenant: str
    cost: int
    wait_s: float
    enqueued: float
    future: asyncio.Future[None] | None = None
    timer: asyncio.TimerHandle | None = None
    state: str = "waiting"
    waited_s: float = 0.0

    @property
    def granted(self) -> bool:
        return self.state == "granted"


@dataclass
class _Band:
    """One tier band's waiters: a FIFO per tenant, served by deficit round-robin."""

    quantum: int
    queues: dict[str, deque[Waiter]] = field(default_factory=dict)
    ring: deque[str] = field(default_factory=deque)  # tenants with waiters; the front has the turn
    deficit: dict[str, float] = field(default_factory=dict)
    turn_granted: bool = False  # the front tenant has had its quantum for this turn

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def push(self, w: Waiter) -> None:
        """A tenant not in the ring (newly active) goes to its front and has the next turn, as
        FQ-CoDel serves new flows first: a tenant that sends a request now and then does not wait
        behind a busy tenant's whole quantum. The busy tenant's turn ends there, its deficit
        carries over. A tenant whose queue emptied stays in the ring until its turn comes round
        again (FQ-CoDel's old flows): one that re-sends as soon as it is served is not new again,
        so it cannot take every next turn and starve the others."""
        q = self.queues.get(w.tenant)
        if q is None:
            q = self.queues[w.tenant] = deque()
            self.ring.appendleft(w.tenant)
            self.turn_granted = False
            self.deficit[w.tenant] = 0.0
        q.append(w)

    def pop(self) -> Waiter | None:
        """The next waiter by deficit round-robin; None when nobody waits (tenants whose queue
        emptied leave the ring when their turn comes round to them empty)."""
        while self.ring:
            tenant = self.ring[0]
            q = self.queues[tenant]
            if not q:
                self._drop(tenant)
                continue
            if not self.turn_granted:
                self.deficit[tenant] += self.quantum
                self.turn_granted = True
            head = q[0]
            if self.deficit[tenant] >= head.cost:
                self.deficit[tenant] -= head.cost
                q.popleft()
                if not q:  # DRR: an emptied queue keeps no deficit, and its turn ends
                    self.deficit[tenant] = 0.0
                    self._next()
                return head
            self._next()  # its deficit carries over to its next turn
        return None

    def _next(self) -> None:
        self.ring.rotate(-1)
        self.turn_granted = False

    def remove(self, w: Waiter) -> None:
        q = self.queues.get(w.tenant)
        if q is None or w not in q:
            return
        q.remove(w)
        if not q:
            self.deficit[w.tenant] = 0.0  # it stays in the ring until its turn, as in ``pop``

    def _drop(self, tenant: str) -> None:
        """A tenant met empty at its turn leaves the ring and loses its deficit (DRR)."""
        if self.ring and self.ring[0] == tenant:
            self.turn_granted = False
        self.ring.remove(tenant)
        del self.queues[tenant]
        del self.deficit[tenant]


class ModelQueue:
    """The waiters of one model, by band (lowest priority value first)."""

    def __init__(self, quantum: int) -> None:
        self.quantum = quantum
        self.bands: dict[int, _Band] = {}

    def __len__(self) -> int:
        return sum(len(b) for b in self.bands.values())

    def push(self, w: Waiter) -> None:
        band = self.bands.get(w.band)
        if band is None:
            band = self.bands[w.band] = _Band(self.quantum)
        band.push(w)

    def pop(self) -> Waiter | None:
        for prio in sorted(self.bands):
            w = self.bands[prio].pop()
            if w is not None:
                return w
        return None

    def pop_band(self, top: int) -> Waiter | None:
        """The next waiter of the bands at priority ``top`` or better, or None."""
        for prio in sorted(self.bands):
            if prio > top:
                break
            w = self.bands[prio].pop()
            if w is not None:
                return w
        return None

    def waiting_in(self, top: int) -> int:
        """Waiters of the bands at priority ``top`` or better."""
        return sum(len(b) for prio, b in self.bands.items() if prio <= top)

    def remove(self, w: Waiter) -> None:
        band = self.bands.get(w.band)
        if band is not None:
            band.remove(w)

    def waiters(self) -> list[Waiter]:
        return [w for prio in sorted(self.bands) for q in self.bands[prio].queues.values() for w in q]


class Flow:
    """The flow queues of one gateway replica, over ``Capacity``'s in-flight counts."""

    def __init__(self, cfg: AppConfig, capacity: Capacity, *,
                 clock: Callable[[], float] = time.monotonic, sink: FlowSink | None = None) -> None:
        self.cfg = cfg
        self.capacity = capacity
        self.clock = clock
        self.sink = sink
        self._models = {m.id: m for m in cfg.models}
        self._queues = {m.id: ModelQueue(m.flow.quantum_tokens) for m in cfg.models if m.flow.enabled}
        # The adaptive bound per running model replica, and when it was last cut.
        self._per_replica = {m.id: float(capacity.lower_slots(m.id)) for m in cfg.models}
        self._last_cut: dict[str, float] = defaultdict(lambda: -math.inf)
        self._top_seen: dict[str, float] = defaultdict(lambda: -math.inf)
        # Whether each of the top tier's last TOP_WINDOW answers was slow (engine-side TTFT over
        # target), per model; emptied at each cut, so the next cut needs answers after it.
        self._top_slow: dict[str, deque[bool]] = defaultdict(lambda: deque(maxlen=TOP_WINDOW))
        self._target_s = min(t.objectives.ttft_p95_ms for t in cfg.tiers.values()
                             if t.priority == cfg.top_priority) / 1000
        self._depth: dict[tuple[str, str, str], int] = defaultdict(int)

    def attach(self, sink: FlowSink) -> None:
        """Report to ``sink`` from now on, starting with each queued model's bound."""
        self.sink = sink
        for model_id in self._queues:
            sink.inflight_bound(model=model_id, bound=self.limit(model_id))

    # -- the bound ---------------------------------------------------------------------------

    def enabled(self, model_id: str) -> bool:
        return model_id in self._queues

    def limit(self, model_id: str) -> int:
        """Requests this gateway replica may have in flight on the model now."""
        self._recover_if_top_quiet(model_id)
        running = max(1, self.capacity.running(model_id))
        per = self._per_replica[model_id]
        if per >= self.capacity.lower_slots(model_id):
            per += self.capacity.ready_slots(model_id)
        total = max(1, math.floor(per * running))
        return max(1, total // self.cfg.gateway.num_replicas)

    def top_limit(self, model_id: str) -> int:
        """Requests this gateway replica may have in flight on the model when the next one is of
        the top tier: the ceiling (and its ready requests), never the adaptive bound."""
        running = max(1, self.capacity.running(model_id))
        per = self.capacity.engine_slots(model_id) + self.capacity.ready_slots(model_id)
        return max(1, per * running // self.cfg.gateway.num_replicas)

    def observe(self, model_id: str, band: int, engine_ttft_s: float) -> None:
        """One finished request's engine-side time to first token (``band``: its tier's
        priority). The top tier's p95 over target cuts the bound: more than ``TOP_SLOW_SHARE`` of
        its last ``TOP_WINDOW`` answers slow (a cut at every slow answer ratcheted the bound down
        to its floor at 2x the base load, where premium's p95 was a third of its objective, and
        batch then waited at the gateway for up to 30 s). A fast answer of any tier grows the
        bound while requests wait (so the bound recovers when the top tier is quiet)."""
        m = self._models.get(model_id)
        if m is None or not self.enabled(model_id) or not m.flow.adaptive:
            return
        slow = engine_ttft_s > m.flow.target_share * self._target_s
        if band <= self.cfg.top_priority:
            self._top_seen[model_id] = self.clock()
            window = self._top_slow[model_id]
            window.append(slow)
            if sum(window) > max(1.0, TOP_SLOW_SHARE * TOP_WINDOW):
                self._cut(model_id)
        cur = self._per_replica[model_id]
        if not slow and len(self._queues[model_id]):
            ceiling = self.capacity.lower_slots(model_id)
            self._per_replica[model_id] = min(float(ceiling), cur + 1.0 / cur)
            self._bound_moved(model_id, cur)

    def _cut(self, model_id: str) -> None:
        """Cut the lower bands' bound by a fifth, at most once per target interval (one burst of
        slow answers is one cut), not below its floor."""
        m = self._models[model_id]
        target = m.flow.target_share * self._target_s
        now = self.clock()
        if now - self._last_cut[model_id] < target:
            return
        cur = self._per_replica[model_id]
        ceiling = self.capacity.lower_slots(model_id)
        floor = min(m.flow.min_inflight_per_replica or max(1, ceiling // 4), ceiling)
        self._per_replica[model_id] = max(float(floor), cur * DECREASE)
        self._last_cut[model_id] = now
        self._top_slow[model_id].clear()
        self._bound_moved(model_id, cur)

    def _recover_if_top_quiet(self, model_id: str) -> None:
        """A bound cut for the top tier's sake serves nobody once the top tier has gone quiet: back
        to the ceiling (the flow bench's fairness phase, right after its 4x phase, ran on a bound
        cut there that grew back by 1/bound per answer, 20-40 s)."""
        ceiling = float(self.capacity.lower_slots(model_id))
        cur = self._per_replica[model_id]
        if cur < ceiling and self.clock() - self._top_seen[model_id] > TOP_QUIET_OBJECTIVES * self._target_s:
            self._per_replica[model_id] = ceiling
            self._bound_moved(model_id, cur)

    def _bound_moved(self, model_id: str, was: float) -> None:
        if self.sink is not None and self._per_replica[model_id] != was:
            self.sink.inflight_bound(model=model_id, bound=self.limit(model_id))

    # -- taking and giving back slots --------------------------------------------------------

    def _free(self, model_id: str, band: int) -> bool:
        """A request of ``band`` may go to the model at once: no queue, or room under its bound
        and nobody waiting ahead of it (for the top band: under the ceiling and no top-tier
        request waiting)."""
        q = self._queues.get(model_id)
        if q is None:
            return True
        inflight = self.capacity.inflight[model_id]
        if band <= self.cfg.top_priority:
            return not q.waiting_in(band) and inflight < self.top_limit(model_id)
        return not len(q) and inflight < self.limit(model_id)

    def _refusal(self, model_id: str, tier_name: str, tier: TierConfig) -> errors.ServiceUnavailable | None:
        q = self._queues.get(model_id)
        waiting = len(q) if q is not None else 0
        refusal = self.capacity.refusal(model_id, tier_name, tier, waiting)
        if refusal is None and q is not None and not self._free(model_id, tier.priority):
            if waiting >= self._models[model_id].flow.max_waiting:
                return errors.Overloaded(
                    f"model {model_id!r} has {waiting} requests waiting at the gateway. "
                    "Retry shortly.", retry_after_s=self.cfg.gateway.http.retry_after_s)
        return refusal

    def reserve(self, model_ids: Sequence[str], tier_name: str, tier: TierConfig, tenant: str,
                cost: int) -> Waiter:
        """A slot on the first candidate with room now, else a place in the first queue that
        takes the request, else the first refusal (raised). Synchronous: no burst passes a bound
        between the check and the count."""
        order = sorted(model_ids, key=lambda m: self.capacity.running(m) == 0)
        if tier.priority <= self.cfg.top_priority:
            for model_id in order:
                self._top_seen[model_id] = self.clock()
        refusals = []
        for model_id in order:
            refusal = self._refusal(model_id, tier_name, tier)
            if refusal is None and self._free(model_id, tier.priority):
                return self._grant_now(model_id, tier_name, tier, tenant, cost)
            if refusal is not None:
                refusals.append(refusal)
        for model_id in order:
            if self.enabled(model_id) and self._refusal(model_id, tier_name, tier) is None:
                return self._enqueue(model_id, tier_name, tier, tenant, cost)
        raise refusals[0]

    def take_now(self, model_id: str, tier_name: str, tier: TierConfig) -> None:
        """A slot on ``model_id`` at once (a fallback after admission), or ServiceUnavailable."""
        refusal = self._refusal(model_id, tier_name, tier)
        if refusal is not None:
            raise refusal
        if not self._free(model_id, tier.priority):
            raise errors.Overloaded(
                f"model {model_id!r} has requests waiting at the gateway. Retry shortly.",
                retry_after_s=self.cfg.gateway.http.retry_after_s)
        self.capacity.inflight[model_id] += 1

    def release(self, model_id: str) -> None:
        """Give back a slot; the next waiters get the room."""
        self.capacity.release(model_id)
        self._dispatch(model_id)

    def _grant_now(self, model_id: str, tier_name: str, tier: TierConfig, tenant: str,
                   cost: int) -> Waiter:
        self.capacity.inflight[model_id] += 1
        w = Waiter(model_id, tier_name, tier.priority, tenant, cost, tier.queue_wait_s, self.clock(),
                   state="granted")
        if self.enabled(model_id) and self.sink is not None:
            self.sink.queue_waited(model=model_id, tier=tier_name, tenant=tenant, seconds=0.0,
                                   outcome="granted")
        return w

    def _enqueue(self, model_id: str, tier_name: str, tier: TierConfig, tenant: str,
                 cost: int) -> Waiter:
        loop = asyncio.get_running_loop()
        w = Waiter(model_id, tier_name, tier.priority, tenant, cost, tier.queue_wait_s, self.clock(),
                   future=loop.create_future())
        w.timer = loop.call_later(w.wait_s, self._expire, w)
        self._queues[model_id].push(w)
        self._count(w, +1)
        self._dispatch(model_id)  # the bound may have grown (a replica started)
        return w

    def _dispatch(self, model_id: str) -> None:
        q = self._queues.get(model_id)
        if q is None:
            return
        while len(q):
            inflight = self.capacity.inflight[model_id]
            if inflight < self.limit(model_id):
                w = q.pop()
            elif inflight < self.top_limit(model_id):
                w = q.pop_band(self.cfg.top_priority)
            else:
                return
            if w is None:
                return
            self.capacity.inflight[model_id] += 1
            self._finish(w, "granted")

    def _expire(self, w: Waiter) -> None:
        if w.state != "waiting":
            return
        self._queues[w.model_id].remove(w)
        self._finish(w, "expired")

    def _finish(self, w: Waiter, state: str) -> None:
        """``w`` leaves its queue: granted a slot, expired, or withdrawn. A top-tier request that
        waited here for a slot means the lower bands hold slots it needed: the bound is cut."""
        w.state = state
        w.waited_s = max(0.0, self.clock() - w.enqueued)
        if (w.band <= self.cfg.top_priority and state != "withdrawn"
                and w.waited_s > TOP_WAIT_CUT * self._target_s
                and self._models[w.model_id].flow.adaptive):
            self._cut(w.model_id)
        if w.timer is not None:
            w.timer.cancel()
        if w.future is not None and not w.future.done():
            w.future.set_result(None)
        self._count(w, -1)
        if self.sink is not None:
            self.sink.queue_waited(model=w.model_id, tier=w.tier, tenant=w.tenant,
                                   seconds=w.waited_s, outcome=state)

    def _count(self, w: Waiter, delta: int) -> None:
        k = (w.model_id, w.tier, w.tenant)
        self._depth[k] += delta
        if self.sink is not None:
            self.sink.queue_depth(model=w.model_id, tier=w.tier, tenant=w.tenant, depth=self._depth[k])

    async def wait(self, w: Waiter) -> None:
        """Until ``w`` has a slot; 503 with Retry-After when its tier's wait bound passes. If the
        caller is cancelled meanwhile, ``w`` leaves its queue, and a slot granted to it is given
        back."""
        if w.state == "waiting" and w.future is not None:
            try:
                await asyncio.shield(w.future)
            except BaseException:
                self.withdraw(w)
                raise
        if w.state == "expired":
            raise errors.QueueTimeout(
                f"model {w.model_id!r} is busy: the request waited {w.wait_s:g} s at the gateway "
                f"(tier {w.tier!r}'s bound). Retry shortly.",
                retry_after_s=self.cfg.gateway.http.retry_after_s)

    def withdraw(self, w: Waiter) -> None:
        """``w``'s request leaves: out of its queue, or its slot given back if it had one."""
        if w.state == "waiting":
            self._queues[w.model_id].remove(w)
            self._finish(w, "withdrawn")
        elif w.state == "granted":
            w.state = "withdrawn"
            self.release(w.model_id)

    # -- what operators see ------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Per queued model: its bound, in flight, and who waits (by tier and tenant) how long."""
        now = self.clock()
        out: dict[str, Any] = {}
        for model_id, q in self._queues.items():
            waiting: dict[str, dict[str, int]] = {}
            oldest: dict[str, float] = {}
            for w in q.waiters():
                waiting.setdefault(w.tier, {}).setdefault(w.tenant, 0)
                waiting[w.tier][w.tenant] += 1
                oldest[w.tier] = max(oldest.get(w.tier, 0.0), round(now - w.enqueued, 3))
            out[model_id] = {
                "bound": self.limit(model_id),
                "bound_per_model_replica": round(self._per_replica[model_id], 2),
                "inflight": self.capacity.inflight[model_id],
                "waiting": len(q),
                "waiting_by_tier_tenant": waiting,
                "oldest_wait_s_by_tier": oldest,
            }
        return out
