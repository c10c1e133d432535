"""Which replica of a model takes a request: session- and prefix-aware, with a load guard.

The gateway chooses the replica itself (``Picker``) and streams from it directly
(``routing.direct``). vLLM's prefix cache lives in one replica. A load balancer that ignores it
(power of two choices, Ray Serve's default) spreads one agent session's turns over the replicas, so
with two or more replicas many turns miss the cache and pay the whole prefill again. With
affinity on (``routing.affinity``), every request with the same affinity key (the gateway's
``RequestContext.affinity``: tenant plus session, or tenant plus a hash of the prompt's leading
text; ``routing.affinity``) goes to the same replica:

- **Rendezvous hashing** ranks the replicas for a key by ``hash(key, replica id)``. It needs no
  shared state, so every gateway replica (each has its own picker) ranks a key the same way, and
  adding or removing a replica moves only the keys whose first choice it is.
- **Bounded load**: a replica takes a request only while its in-flight count stays within
  ``ceil(load_factor * (in flight + 1) / replicas)``; otherwise the key goes to its next-ranked
  replica under the bound (a *spill*). One long system prompt shared by every session can so never
  pin all traffic to one replica (production-stack #957).
- **Re-homing**: a spilled key remembers its new home and stays there while that home is under the
  bound, instead of bouncing back and forth (each bounce would be a cold prefill). The memory is
  bounded (least recently used keys are forgotten and fall back to their hash rank).

A replica's load is the larger of this gateway replica's own in-flight count there and the
replica's own count as it last reported it (in the head of each answer, ``serve_app.wire``: it
counts every gateway's requests). So with several gateway replicas the guard sees the others'
requests too, as of the last answer from that replica. A request without a key (an embedding
model's, a probe), or any request with affinity off, takes the less loaded of two replicas picked
at random (power of two choices). ``AffinityTable`` is the pure policy; ``Picker`` adds the loads.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

# How a request was placed: at its key's home (``affinity``), first sighting of its key (``new``),
# moved off an over-loaded home (``spill``), or without a key (``none``).
Decision = Literal["affinity", "new", "spill", "none"]
DECISIONS: tuple[Decision, ...] = ("affinity", "new", "spill", "none")
DEFAULT_LOAD_FACTOR = 1.25
DEFAULT_MAX_KEYS = 65_536


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


class Picker:
    """One model's replica choice in one gateway replica: the affinity table (when the model uses
    it), the requests this gateway has in flight on each replica, and what each last reported."""

    def __init__(self, affinity: bool, load_factor: float = DEFAULT_LOAD_FACTOR,
                 max_keys: int = DEFAULT_MAX_KEYS, rng: random.Random | None = None) -> None:
        self.table = AffinityTable(load_factor, max_keys) if affinity else None
        self.in_flight: dict[str, int] = {}
        self.reported: dict[str, int] = {}
        self._rng = rng or random.Random()

    def load(self, replica: str) -> int:
        return max(self.in_flight.get(replica, 0), self.reported.get(replica, 0))

    def choose(self, key: str, replicas: Sequence[str]) -> Placement:
        """The replicas in order of preference for a request with affinity ``key``."""
        load = {r: self.load(r) for r in replicas}
        if self.table is not None and key:
            return self.table.place(key, replicas, load)
        if len(replicas) <= 2:
            return Placement(sorted(replicas, key=lambda r: (load[r], r)), "none")
        two = self._rng.sample(list(replicas), 2)
        first = min(two, key=lambda r: load[r])
        return Placement([first, *sorted((r for r in replicas if r != first),
                                         key=lambda r: (load[r], r))], "none")

    def sent(self, replica: str) -> None:
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1

    def done(self, replica: str) -> None:
        left = self.in_flight.get(replica, 0) - 1
        if left > 0:
            self.in_flight[replica] = left
        else:
            self.in_flight.pop(replica, None)
        # The replica's last report counted this request (it reports after taking it).
        if self.reported.get(replica, 0) > 0:
            self.reported[replica] -= 1

    def report(self, replica: str, load: int) -> None:
        """The replica's own count of its requests, as its last head said."""
        self.reported[replica] = load

    def keep_only(self, replicas: Sequence[str]) -> None:
        """Replicas that left: their remembered keys and loads are forgotten."""
        live = set(replicas)
        for gone in [r for r in self.reported if r not in live]:
            self.reported.pop(gone, None)
            if self.table is not None:
                self.table.forget_replica(gone)
