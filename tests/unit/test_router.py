"""Affinity routing (serve_app.gateway.routing.placement, serve_app.gateway.routing.affinity) and
its config.

The policy is checked without Ray: which replica a key goes to, how the load bound moves it, and
what adding or removing a replica moves; then the gateway's ``Picker``, which adds its own in-flight
counts and the counts the replicas report."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from pydantic import ValidationError

from serve_app.gateway.routing import affinity
from serve_app.gateway.routing.placement import (
    AffinityTable,
    Picker,
    load_bound,
    rank,
)
from serve_app.protocol import ENDPOINTS
from tests.unit.builders import model

REPLICAS = [f"r{i}" for i in range(4)]
KEYS = [f"tenant-{t}/session-{s}" for t in range(50) for s in range(4)]


def idle(replicas: list[str]) -> dict[str, int]:
    return dict.fromkeys(replicas, 0)


# ---- the policy -----------------------------------------------------------------------------------
def test_a_key_stays_on_one_replica_while_load_allows() -> None:
    table = AffinityTable()
    first = table.place("k", REPLICAS, idle(REPLICAS))
    assert first.decision == "new"
    for _ in range(10):
        again = table.place("k", REPLICAS, idle(REPLICAS))
        assert again.order[0] == first.order[0] and again.decision == "affinity"


def test_keys_spread_over_replicas() -> None:
    table = AffinityTable()
    homes = Counter(table.place(k, REPLICAS, idle(REPLICAS)).order[0] for k in KEYS)
    assert set(homes) == set(REPLICAS)
    assert max(homes.values()) / min(homes.values()) < 1.6


def test_two_routers_agree_without_sharing_state() -> None:
    """Two gateway replicas each have their own router: pure hashing sends a key to the same place,
    whatever order they learnt the replicas in."""
    a, b = AffinityTable(), AffinityTable()
    shuffled = random.Random(1).sample(REPLICAS, len(REPLICAS))
    for k in KEYS:
        assert a.place(k, REPLICAS, idle(REPLICAS)).order == b.place(k, shuffled, idle(shuffled)).order


def test_load_guard_bounds_every_replica() -> None:
    """One hot key (everyone shares one system prompt): no replica goes above the bound, however
    many requests are in flight."""
    table = AffinityTable(load_factor=1.25)
    load = idle(REPLICAS)
    for _ in range(200):
        choice = table.place("hot", REPLICAS, load).order[0]
        bound = load_bound(1.25, sum(load.values()), len(REPLICAS))
        load[choice] += 1
        assert load[choice] <= bound
    assert max(load.values()) <= 1.25 * sum(load.values()) / len(REPLICAS) + 1


def test_bound_is_over_the_mean() -> None:
    assert load_bound(1.25, 0, 2) == 1
    assert load_bound(1.25, 7, 2) == 5  # ceil(1.25 * 8 / 2)
    assert load_bound(2.0, 9, 4) == 5


def test_a_spilled_key_rehomes_instead_of_bouncing() -> None:
    table = AffinityTable(load_factor=1.25)
    home = table.place("k", REPLICAS, idle(REPLICAS)).order[0]
    busy = {**idle(REPLICAS), home: 10}
    spilled = table.place("k", REPLICAS, busy)
    assert spilled.decision == "spill" and spilled.order[0] != home
    new_home = spilled.order[0]
    # The old home is idle again: the key stays where its cache now is.
    for _ in range(3):
        again = table.place("k", REPLICAS, idle(REPLICAS))
        assert again.order[0] == new_home and again.decision == "affinity"


def test_spill_goes_to_the_keys_next_rank() -> None:
    """Deterministic spill: two gateways that spill the same key spill it to the same replica."""
    order = rank("k", REPLICAS)
    spilled = AffinityTable().place("k", REPLICAS, {**idle(REPLICAS), order[0]: 10})
    assert spilled.order[0] == order[1]


def test_adding_a_replica_moves_only_the_keys_it_takes() -> None:
    table = AffinityTable()
    before = {k: table.place(k, REPLICAS, idle(REPLICAS)).order[0] for k in KEYS}
    grown = [*REPLICAS, "r4"]
    after = {k: table.place(k, grown, idle(grown)).order[0] for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "r4" for k in moved)
    assert 0.1 < len(moved) / len(KEYS) < 0.3  # about 1/5


def test_removing_a_replica_moves_only_its_keys() -> None:
    table = AffinityTable()
    before = {k: table.place(k, REPLICAS, idle(REPLICAS)).order[0] for k in KEYS}
    table.forget_replica("r2")
    shrunk = [r for r in REPLICAS if r != "r2"]
    after = {k: table.place(k, shrunk, idle(shrunk)).order[0] for k in KEYS}
    assert {k for k in KEYS if before[k] != after[k]} == {k for k in KEYS if before[k] == "r2"}


def test_a_key_rehomed_on_a_removed_replica_follows_its_rank_again() -> None:
    table = AffinityTable()
    order = rank("k", REPLICAS)
    table.place("k", REPLICAS, {**idle(REPLICAS), order[0]: 10})  # re-homed to order[1]
    table.forget_replica(order[1])
    rest = [r for r in REPLICAS if r != order[1]]
    assert table.place("k", rest, idle(rest)).order[0] == order[0]


def test_remembered_keys_are_bounded() -> None:
    table = AffinityTable(max_keys=3)
    for k in "abcde":
        table.place(k, REPLICAS, idle(REPLICAS))
    assert table.place("a", REPLICAS, idle(REPLICAS)).decision == "new"  # forgotten
    assert table.place("e", REPLICAS, idle(REPLICAS)).decision == "affinity"


def test_no_key_takes_the_least_loaded_replica() -> None:
    placed = AffinityTable().place("", REPLICAS, {"r0": 3, "r1": 1, "r2": 0, "r3": 2})
    assert placed.decision == "none" and placed.order == ["r2", "r1", "r3", "r0"]


def test_load_factor_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"load_factor \(0.9\) must be >= 1.0"):
        AffinityTable(load_factor=0.9)


# ---- the gateway's picker --------------------------------------------------------------------------
def test_picker_keeps_a_key_home_and_spills_on_its_own_in_flight_count() -> None:
    p = Picker(affinity=True)
    home = p.choose("s", ["a", "b"]).order[0]
    assert p.choose("s", ["a", "b"]).decision == "affinity"
    for _ in range(3):
        p.sent(home)  # sent and not answered yet
    spilled = p.choose("s", ["a", "b"])
    assert spilled.order[0] != home and spilled.decision == "spill"
    for _ in range(3):
        p.done(home)
    assert p.in_flight == {}


def test_picker_spills_on_the_load_other_gateways_put_on_the_home() -> None:
    """The replica's own count (in each answer's head: every gateway's requests) counts even when
    this gateway sent nothing there."""
    p = Picker(affinity=True)
    home = p.choose("s", ["a", "b"]).order[0]
    p.report(home, 3)  # another gateway's three requests
    assert p.choose("s", ["a", "b"]).order[0] != home
    p.keep_only(["a", "b"])
    assert p.reported == {home: 3}
    p.keep_only([r for r in ("a", "b") if r != home])  # the home left
    assert p.reported == {}


def test_picker_without_affinity_takes_the_less_loaded_of_two() -> None:
    p = Picker(affinity=False, rng=random.Random(0))
    replicas = ["a", "b", "c", "d"]
    for r, n in zip(replicas, (5, 0, 5, 5), strict=True):
        p.report(r, n)
    firsts = Counter(p.choose("ignored", replicas).order[0] for _ in range(400))
    # "b" wins whenever it is one of the two drawn (half the draws); the others split the rest.
    assert 150 < firsts["b"] < 250 and sum(firsts.values()) == 400
    assert all(p.choose("", replicas).decision == "none" for _ in range(3))
    assert p.choose("", ["a", "b"]).order == ["b", "a"]


# ---- the gateway's key -----------------------------------------------------------------------------
CHAT = ENDPOINTS["chat"]


def _chat(system: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
            **extra}


def test_session_header_wins_and_keys_differ_by_tenant() -> None:
    h = {"x-claude-code-session-id": "abc"}
    a1 = affinity.affinity_key("tenant-a", CHAT, h, _chat("s", "turn 1"))
    a2 = affinity.affinity_key("tenant-a", CHAT, h, _chat("other", "turn 2"))
    b = affinity.affinity_key("tenant-b", CHAT, h, _chat("s", "turn 1"))
    assert a1 == a2 and a1 != b


@pytest.mark.parametrize("headers,body", [
    ({"session-id": "abc"}, {}),  # Codex
    ({}, {"prompt_cache_key": "abc"}),
    ({}, {"user": "abc"}),
])
def test_other_session_sources(headers: dict[str, str], body: dict[str, Any]) -> None:
    one = affinity.affinity_key("t", CHAT, headers, _chat("x", "1", **body))
    two = affinity.affinity_key("t", CHAT, headers, _chat("y", "2", **body))
    assert one == two


def test_without_a_session_the_leading_text_decides() -> None:
    long_system = "rules " * 2000
    one = affinity.affinity_key("t", CHAT, {}, _chat(long_system, "question 1"))
    two = affinity.affinity_key("t", CHAT, {}, _chat(long_system, "question 2"))
    other = affinity.affinity_key("t", CHAT, {}, _chat("other rules " * 1000, "question 1"))
    assert one == two != other


def test_leading_text_reads_the_prompt_in_order() -> None:
    body = {"system": [{"type": "text", "text": "SYS"}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "U1"}]},
                         {"role": "user", "content": "U2"}]}
    assert affinity.leading_text(body, ENDPOINTS["messages"]) == "SYSU1U2"
    assert affinity.leading_text({"prompt": "abcdef"}, ENDPOINTS["completions"], limit=3) == "abc"


def test_the_key_carries_no_session_or_prompt_text() -> None:
    key = affinity.affinity_key("t", CHAT, {"x-claude-code-session-id": "secret-session"},
                                _chat("secret prompt", "x"))
    assert "secret" not in key and len(key) == 32


# ---- config and wiring -------------------------------------------------------------------------------
def test_auto_is_on_for_chat_models_with_more_than_one_replica() -> None:
    assert not model().affinity_routing
    assert model(deployment={"num_replicas": 2}).affinity_routing
    assert model(deployment={"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}).affinity_routing
    assert not model(task="embed", deployment={"num_replicas": 2}).affinity_routing
    assert not model(deployment={"num_replicas": 2}, routing={"affinity": "off"}).affinity_routing
    assert model(routing={"affinity": "on"}).affinity_routing


def test_routing_config_is_validated() -> None:
    with pytest.raises(ValidationError, match="load_factor"):
        model(routing={"load_factor": 0.5})
    with pytest.raises(ValidationError, match="routing.affinity \\('on'\\) needs a generate model"):
        model(task="embed", routing={"affinity": "on"})
    with pytest.raises(ValidationError, match="extra"):
        model(routing={"affinty": "on"})


def test_ray_serve_accepts_the_model_options() -> None:
    from typing import cast

    from ray.serve.deployment import Deployment

    from serve_app.app import model_deployment_options
    from serve_app.engine.deployment import ModelServer

    opts = model_deployment_options(model(deployment={"num_replicas": 2}))
    assert "request_router_config" not in opts  # the gateway places requests itself
    cast(Deployment, ModelServer).options(**opts)
