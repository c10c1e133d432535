"""Session- and prefix-aware routing across a model's replicas, with a load guard.

vLLM's prefix cache lives in one replica. Ray Serve's default router (power of two choices) spreads
one agent session's turns over the replicas, so with two or more replicas many turns miss the cache
and pay the whole prefill again. ``AffinityRouter`` sends every request with the same affinity key
(the gateway's ``RequestContext.affinity``: tenant plus session, or tenant plus a hash of the
prompt's leading text; ``serve_app.gateway.routing.affinity``) to the same replica:

- **Rendezvous hashing** ranks the replicas for a key by ``hash(key, replica id)``. It needs no
  shared state, so every gateway replica (each has its own router) ranks a key the same way, and
  adding or removing a replica moves only the keys whose first choice it is.
- **Bounded load**: a replica takes a request only while its in-flight count stays within
  ``ceil(load_factor * (in flight + 1) / replicas)``; otherwise the key goes to its next-ranked
  replica under the bound (a *spill*). One long system prompt shared by every session can so never
  pin all traffic to one replica (production-stack #957).
- **Re-homing**: a spilled key remembers its new home and stays there while that home is under the
  bound, instead of bouncing back and forth (each bounce would be a cold prefill). The memory is
  bounded (least recently used keys are forgotten and fall back to their hash rank).

A replica's load is the larger of this router's own in-flight count (one router per gateway
replica: sent minus completed) and the replica's own count of ongoing requests as it last
reported it to this router (Ray Serve's queue-length cache: each replica returns its count when it
accepts a request, and it counts every gateway's requests). So with several gateway replicas the
guard sees the others' requests too, as of this router's last send to that replica. A request
without a key (an embedding model's, a probe) takes the least-loaded replica. ``AffinityTable``
is the pure policy (unit-tested without Ray); ``AffinityRouter`` plugs it into Ray Serve's
``RequestRouter`` API (``RequestRouterConfig``, wired by ``serve_app.app``).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

# How a request was placed: at its key's home (``affinity``), first sighting of its key (``new``),
# moved off an over-loaded home (``spill``), or without a key (``none``).
Decision = Literal["affinity", "new", "spill", "none"]
DECISIONS: tuple[Decision, ...] = ("affinity", "new", "spill", "none")
DEFAULT_LOAD_FACTOR = 1.25
DEFAULT_MAX_KEYS = 65_536
ROUTER_PATH = "serve_app.engine.router:AffinityRouter"
# Where the gateway's key travels: the third positional argument of the model's ``handle``
# (``RequestContext.to_dict()``), under this name.
CONTEXT_ARG, AFFINITY_FIELD = 2, "affinity"


def rank(key: str, replicas: Sequence[str]) -> list[str]:
    """``replicas`` in ``key``'s rendezvous order (highest random weight first). Pure: every
    process that knows the same replica ids ranks a key the same way."""
    def weight(replica: str) -> tuple[bytes, str]:
        digest = hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()
        return digest, replica
    return sorted(replicas, key=weight, reverse=True)


def load_bound(load_factor: float, in_flight: int, replicas: int) -> int:
    """The most requests one replica may hold once this one is placed: ``load_factor`` over the
    mean, rounded up, so at least one replica always has room."""
    return max(1, math.ceil(load_factor * (in_flight + 1) / max(1, replicas)))


@dataclass(frozen=True)
class Placement:
    """Where one request goes: replicas in order of preference (the first is the choice; the rest
    are for Ray Serve when the choice's queue is full), and why."""

    order: list[str]
    decision: Decision


class AffinityTable:
    """The routing policy: keys to replicas by rendezvous hashing, under a load bound, with the
    homes of spilled keys remembered (at most ``max_keys``, least recently used first out)."""

    def __init__(self, load_factor: float = DEFAULT_LOAD_FACTOR,
                 max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if load_factor < 1.0:
            raise ValueError(f"load_factor ({load_factor}) must be >= 1.0")
        self.load_factor = load_factor
        self.max_keys = max_keys
        # key -> its remembered home, or None while it follows its hash rank.
        self._keys: OrderedDict[str, str | None] = OrderedDict()

    def place(self, key: str, replicas: Sequence[str], load: Mapping[str, int]) -> Placement:
        """Choose a replica for a request with affinity ``key`` (empty: none), given each
        replica's in-flight requests."""
        if not replicas:
            return Placement([], "none")
        if not key:
            return Placement(sorted(replicas, key=lambda r: (load.get(r, 0), r)), "none")
        order = rank(key, replicas)
        seen = key in self._keys
        remembered = self._keys.get(key)
        home = remembered if remembered is not None and remembered in replicas else order[0]
        bound = load_bound(self.load_factor, sum(load.get(r, 0) for r in replicas), len(replicas))
        decision: Decision = "affinity" if seen else "new"
        choice = home
        if load.get(home, 0) + 1 > bound:
            # The first replica under the bound in the key's own rank: deterministic, so two
            # gateways that spill the same key spill it to the same place.
            choice = next(r for r in order if load.get(r, 0) + 1 <= bound)
            decision = "spill"
        self._remember(key, None if choice == order[0] else choice)
        return Placement([choice, *(r for r in order if r != choice)], decision)

    def forget_replica(self, replica: str) -> None:
        """A replica left: keys homed there follow their hash rank again."""
        for key, home in self._keys.items():
            if home == replica:
                self._keys[key] = None

    def _remember(self, key: str, home: str | None) -> None:
        self._keys[key] = home
        self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)


def affinity_key(pending_request: PendingRequest | None) -> str:
    """The gateway's affinity key of a request to ``ModelServer.handle`` ("" when it has none)."""
    if pending_request is None or len(pending_request.args) <= CONTEXT_ARG:
        return ""
    ctx = pending_request.args[CONTEXT_ARG]
    key = ctx.get(AFFINITY_FIELD, "") if isinstance(ctx, dict) else ""
    return key if isinstance(key, str) else ""


class AffinityRouter(RequestRouter):
    """Ray Serve request router that places requests with ``AffinityTable``.

    Not a ``FIFOMixin`` router on purpose: Ray Serve then hands the chosen replica to exactly the
    request it was chosen for, never to an older one with another key."""

    def initialize_state(self, **kwargs: Any) -> None:
        """``RequestRouterConfig.request_router_kwargs``: ``load_factor``, ``max_keys``."""
        self._table = AffinityTable(float(kwargs.get("load_factor", DEFAULT_LOAD_FACTOR)),
                                    int(kwargs.get("max_keys", DEFAULT_MAX_KEYS)))
        self._in_flight: dict[ReplicaID, int] = {}
        self._deployment = self._deployment_id.name if self._deployment_id else ""
        self._metrics: Any = None

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """One rank per replica, in the placement's order: Ray Serve takes the first whose queue
        is not full (``max_ongoing_requests``)."""
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        load = {r.replica_id.unique_id: self._load(r.replica_id) for r in candidate_replicas}
        placement = self._table.place(affinity_key(pending_request), list(by_id), load)
        self._record(placement.decision)
        if pending_request is not None:
            # Every replica is offered at once; if none takes it, Ray Serve waits before asking again.
            pending_request.routing_context.should_backoff = True
        return [[by_id[r]] for r in placement.order]

    def _load(self, replica_id: ReplicaID) -> int:
        """This router's own in-flight count, or the replica's last reported count of ongoing
        requests (every gateway's) if larger."""
        reported = self._replica_queue_len_cache.get(replica_id)
        return max(self._in_flight.get(replica_id, 0), reported or 0)

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        left = self._in_flight.get(replica_id, 0) - 1
        if left > 0:
            self._in_flight[replica_id] = left
        else:
            self._in_flight.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self._replica_id_set) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self._table.forget_replica(replica_id.unique_id)
            self._in_flight.pop(replica_id, None)

    def _record(self, decision: Decision) -> None:
        if self._metrics is None:
            from serve_app.metrics import RouterMetrics  # in the handle's process, once

            self._metrics = RouterMetrics.create()
        self._metrics.routed(deployment=self._deployment, decision=decision)
