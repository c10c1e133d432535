"""The gateway's flow queue: who goes next (bands, tenants, token weights) and its bounds (wait
timeout, cancellation, shedding, several gateway replicas, the adaptive bound)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from serve_app import errors
from serve_app.config import AppConfig, KeyRecord
from serve_app.gateway.accounting.timing import StageClock
from serve_app.gateway.admission.admission import Admission
from serve_app.gateway.admission.capacity import Capacity
from serve_app.gateway.admission.flow import Flow, Waiter
from serve_app.gateway.http.api import GatewayDeps, build_api
from serve_app.ops.diagnose import flow_lines
from serve_app.state.limits import MemoryBackend
from tests.keys import create_key
from tests.unit.test_api import FakeModels, _gateway_deps

DIGEST = "sha256:" + "0" * 64


def _cfg(*, inflight: int = 2, gateway_replicas: int = 1, enabled: bool = True,
         batch_wait_s: float = 5.0, saturation: int | None = None, adaptive: bool = False,
         engine_replicas: int = 1, reserved: int = 0, **flow: Any) -> AppConfig:
    return AppConfig.model_validate({
        "tiers": {
            "premium": {"priority": 0, "objectives": {"ttft_p95_ms": 1000}, "max_queue_wait_s": 5,
                        "key_limits": {"max_concurrent": 64}},
            "standard": {"priority": 5, "max_queue_wait_s": 5, "shed_at": 0.8},
            "batch": {"priority": 10, "shed_at": 0.5, "max_queue_wait_s": batch_wait_s},
        },
        "default_tier": "standard",
        # (several replicas with limits need Redis in the config; these tests use MemoryBackend)
        "gateway": {"num_replicas": gateway_replicas,
                    "state": {"redis_url": "redis://127.0.0.1:1/0" if gateway_replicas > 1 else None}},
        "models": [{
            "id": "tiny", "source": "builtin:tiny-chat",
            "engine": {"max_num_seqs": 64, "scheduling_policy": "priority"},
            "deployment": {"num_replicas": engine_replicas},
            "admission": {"saturation_requests": saturation, "reserved_slots": reserved},
            "flow": {"enabled": enabled, "max_inflight_per_replica": inflight, "ready_per_replica": 0,
                     "min_inflight_per_replica": 1, "adaptive": adaptive, "quantum_tokens": 100,
                     **flow},
        }],
    })


def _flow(cfg: AppConfig) -> Flow:
    return Flow(cfg, Capacity(cfg))


def _key(key_id: str, tier: str = "standard", tenant: str | None = None) -> KeyRecord:
    return KeyRecord(id=key_id, digest=DIGEST, tier=tier, tenant=tenant)


def run(coro: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(coro())  # type: ignore[arg-type]


def _drain(flow: Flow, waiters: list[Waiter]) -> list[Waiter]:
    """Release one slot at a time and record who gets it, until nobody waits."""
    order = []
    while any(w.state == "waiting" for w in waiters):
        flow.release("tiny")
        order += [w for w in waiters if w.granted and w not in order]
    return order


def _reserve(flow: Flow, cfg: AppConfig, tier: str, tenant: str, cost: int = 100) -> Waiter:
    return flow.reserve(["tiny"], tier, cfg.tiers[tier], tenant, cost)


def test_dequeue_is_strictly_by_tier_band() -> None:
    cfg = _cfg(inflight=1)

    async def go() -> list[str]:
        flow = _flow(cfg)
        first = _reserve(flow, cfg, "standard", "a")
        assert first.granted  # a free slot: no wait
        waiters = [_reserve(flow, cfg, "batch", "b"), _reserve(flow, cfg, "standard", "c"),
                   _reserve(flow, cfg, "batch", "d"), _reserve(flow, cfg, "premium", "e")]
        return [w.tier for w in _drain(flow, waiters)]

    assert run(go) == ["premium", "standard", "batch", "batch"]


def test_within_a_band_tenants_take_turns() -> None:
    cfg = _cfg(inflight=1)

    async def go() -> list[str]:
        flow = _flow(cfg)
        _reserve(flow, cfg, "standard", "noisy")  # holds the one slot
        waiters = [_reserve(flow, cfg, "standard", "noisy") for _ in range(6)]
        waiters += [_reserve(flow, cfg, "standard", "quiet") for _ in range(2)]
        return [w.tenant for w in _drain(flow, waiters)]

    # The quiet tenant's two requests arrived after six of the noisy one's: newly active, it has
    # the next turn (1st), then the two take turns (3rd).
    assert run(go) == ["quiet", "noisy", "quiet", "noisy", "noisy", "noisy", "noisy", "noisy"]


def test_tenants_are_weighted_by_tokens() -> None:
    cfg = _cfg(inflight=1)  # quantum 100 tokens per turn

    async def go() -> dict[str, int]:
        flow = _flow(cfg)
        _reserve(flow, cfg, "standard", "x")
        big = [_reserve(flow, cfg, "standard", "big", cost=200) for _ in range(10)]
        small = [_reserve(flow, cfg, "standard", "small", cost=50) for _ in range(40)]
        order = _drain(flow, big + small)[:24]  # while both still wait
        tokens = {"big": 0, "small": 0}
        for w in order:
            tokens[w.tenant] += w.cost
        return tokens

    tokens = run(go)
    # Same tokens per round for both, whatever the size of their requests.
    assert abs(tokens["big"] - tokens["small"]) <= 200, tokens


def test_a_request_past_its_tiers_wait_gets_503_with_retry_after_and_takes_nothing() -> None:
    cfg = _cfg(inflight=1, batch_wait_s=0.05)
    adm = Admission(cfg, MemoryBackend())
    key = _key("b", "batch")

    async def go() -> None:
        holder = await adm.admit(_key("p", "premium"), ["tiny"], {"max_tokens": 8}, 10)
        await adm.queue(holder)
        ticket = await adm.admit(key, ["tiny"], {"max_tokens": 8}, 10)
        clock = StageClock(0.0, clock=lambda: 1.0)
        with pytest.raises(errors.ServiceUnavailable) as err:
            await adm.queue(ticket, clock)
        assert err.value.status == 503 and int(err.value.headers["Retry-After"]) >= 1
        assert err.value.to_body()["error"]["code"] == "queue_timeout"
        assert "waited 0.05 s" in err.value.message
        assert adm.inflight["tiny"] == 1 and not adm.flow.snapshot()["tiny"]["waiting"]
        assert ticket.settled  # its charge refunded: the key may send another at once
        await adm.settle(holder, 10)
        assert adm.inflight["tiny"] == 0

    run(go)


def test_a_cancelled_waiter_leaves_the_queue_and_leaks_no_slot() -> None:
    cfg = _cfg(inflight=1)
    adm = Admission(cfg, MemoryBackend())
    key = _key("p", "premium")

    async def go() -> None:
        holder = await adm.admit(key, ["tiny"], {"max_tokens": 8}, 10)
        ticket = await adm.admit(key, ["tiny"], {"max_tokens": 8}, 10)
        task = asyncio.ensure_future(adm.queue(ticket))
        await asyncio.sleep(0.01)
        assert adm.flow.snapshot()["tiny"]["waiting"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert adm.flow.snapshot()["tiny"]["waiting"] == 0 and adm.inflight["tiny"] == 1
        await adm.settle(holder, 10)
        assert adm.inflight["tiny"] == 0  # the slot went to nobody: the cancelled one took none
        # Its concurrency charge was given back: 64 more premium requests fit.
        again = [await adm.admit(key, ["tiny"], {"max_tokens": 8}, 10) for _ in range(64)]
        assert len(again) == 64
        for t in again:
            await adm.settle(t, 1)

    run(go)


def test_a_slot_granted_to_a_waiter_that_was_cancelled_meanwhile_is_given_back() -> None:
    cfg = _cfg(inflight=1)
    adm = Admission(cfg, MemoryBackend())
    key = _key("p", "premium")

    async def go() -> None:
        holder = await adm.admit(key, ["tiny"], {"max_tokens": 8}, 10)
        ticket = await adm.admit(key, ["tiny"], {"max_tokens": 8}, 10)
        third = await adm.admit(key, ["tiny"], {"max_tokens": 8}, 10)
        task = asyncio.ensure_future(adm.queue(ticket))
        await asyncio.sleep(0.01)
        await adm.settle(holder, 10)  # grants the slot to `ticket` ...
        task.cancel()  # ... whose client leaves before it resumes
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ticket.waiter is not None and not ticket.waiter.granted
        # The slot went on to the next waiter; nothing leaked.
        assert third.waiter is not None and third.waiter.granted and adm.inflight["tiny"] == 1
        await adm.settle(third, 1)
        assert adm.inflight["tiny"] == 0

    run(go)


def test_shed_at_is_the_queues_admission_policy() -> None:
    # saturation 4: batch (shed_at 0.5) is refused once 2 are held, in flight or waiting.
    cfg = _cfg(inflight=1, saturation=4)

    async def go() -> None:
        flow = _flow(cfg)
        _reserve(flow, cfg, "premium", "p")
        _reserve(flow, cfg, "batch", "b")  # waits: 2 held
        with pytest.raises(errors.Shed):
            _reserve(flow, cfg, "batch", "b")
        assert _reserve(flow, cfg, "premium", "p").state == "waiting"  # premium still queues

    run(go)


def test_the_queue_itself_is_bounded() -> None:
    cfg = _cfg(inflight=1, max_waiting=2)

    async def go() -> None:
        flow = _flow(cfg)
        _reserve(flow, cfg, "premium", "p")
        _reserve(flow, cfg, "premium", "p")
        _reserve(flow, cfg, "premium", "p")
        with pytest.raises(errors.ServiceUnavailable, match="2 requests waiting"):
            _reserve(flow, cfg, "premium", "p")

    run(go)


@pytest.mark.parametrize(("gateways", "engines"), [(1, 1), (2, 1), (3, 1), (3, 2), (5, 3)])
def test_per_replica_queues_together_never_pass_the_bound(gateways: int, engines: int) -> None:
    """Each of N gateway replicas gets bound // N: the sum never passes the model's bound, and
    loses at most N - 1 slots to the rounding."""
    cfg = _cfg(inflight=16, gateway_replicas=gateways, engine_replicas=engines)

    async def go() -> int:
        total = 0
        for _ in range(gateways):  # each replica its own Flow, as on separate processes
            flow = _flow(cfg)
            for _ in range(100):
                w = _reserve(flow, cfg, "premium", "p")
                total += w.granted
        return total

    bound = 16 * engines
    granted = run(go)
    assert bound - (gateways - 1) <= granted <= bound


def test_the_bound_follows_the_running_replicas() -> None:
    cfg = _cfg(inflight=3, engine_replicas=1)
    flow = _flow(cfg)
    assert flow.limit("tiny") == 3

    class Two:
        def running(self, model_id: str) -> int:
            return 2

    flow.capacity.replicas = Two()  # type: ignore[assignment]
    assert flow.limit("tiny") == 6


def test_ready_requests_pass_the_ceilings_but_not_a_cut_bound() -> None:
    """``ready_per_replica`` more in flight than each ceiling (they wait in the replica's slot gate,
    ready for a freed slot), per running model replica; a bound the adaptive control cut gets none."""
    now = [0.0]
    cfg = _cfg(inflight=20, reserved=4, adaptive=True, min_inflight_per_replica=4,
               ready_per_replica=3, engine_replicas=2)
    flow = Flow(cfg, Capacity(cfg), clock=lambda: now[0])
    assert flow.limit("tiny") == (16 + 3) * 2 and flow.top_limit("tiny") == (20 + 3) * 2

    async def go() -> list[str]:
        waiters = [_reserve(flow, cfg, "batch", "b") for _ in range(40)]
        waiters += [_reserve(flow, cfg, "premium", "p") for _ in range(10)]
        return [w.tier for w in waiters if w.granted]

    granted = run(go)
    assert granted.count("batch") == 38 and granted.count("premium") == 46 - 38
    for _ in range(2):
        flow.observe("tiny", 0, 2.0)  # the top tier's p95 is slow: the lower bound is cut
    assert flow.limit("tiny") == math.floor(16 * 0.8 * 2)
    assert flow.top_limit("tiny") == (20 + 3) * 2


@pytest.mark.parametrize(("ready", "seqs", "ongoing", "expect"),
                         [(None, 64, 128, 8), (None, 4, 64, 0), (5, 64, 128, 5), (8, 64, 66, 2)])
def test_ready_requests_default_to_an_eighth_and_fit_the_replica(
        ready: int | None, seqs: int, ongoing: int, expect: int) -> None:
    cfg = AppConfig.model_validate({
        "models": [{"id": "tiny", "source": "builtin:tiny-chat", "engine": {"max_num_seqs": seqs},
                    "deployment": {"max_ongoing_requests": ongoing},
                    "flow": {"enabled": True, "ready_per_replica": ready}}]})
    assert Capacity(cfg).ready_slots("tiny") == expect


def test_the_adaptive_bound_cuts_when_the_engine_is_slow_and_grows_while_requests_wait() -> None:
    now = [0.0]
    cfg = _cfg(inflight=20, adaptive=True, min_inflight_per_replica=4, target_share=0.5)
    flow = Flow(cfg, Capacity(cfg), clock=lambda: now[0])
    assert flow.limit("tiny") == 20
    flow.observe("tiny", 0, 0.9)  # over 0.5 x 1 s, but one answer is not the p95: no cut
    assert flow.limit("tiny") == 20
    flow.observe("tiny", 0, 0.9)  # two of the last answers (> 5 % of 20): cut
    assert flow.limit("tiny") == 16
    flow.observe("tiny", 0, 0.9)
    flow.observe("tiny", 0, 0.9)  # the same burst (within one target interval): no second cut
    assert flow.limit("tiny") == 16
    for _ in range(20):
        now[0] += 1.0
        flow.observe("tiny", 0, 2.0)
    assert flow.limit("tiny") == 4  # never under the floor
    flow.observe("tiny", 0, 0.1)  # fast, but nobody waits: no reason to grow
    assert flow.limit("tiny") == 4
    now[0] += 1.0
    flow.observe("tiny", 10, 5.0)  # batch's first token is slow by design: no cut
    assert flow.limit("tiny") == 4

    async def go() -> None:
        for _ in range(10):
            _reserve(flow, cfg, "standard", "s")  # 4 go in, 6 wait
        for _ in range(40):
            flow.observe("tiny", 0, 0.1)

    run(go)
    assert 8 <= flow.limit("tiny") <= 20


def test_the_bound_is_cut_on_the_top_tiers_p95_not_on_each_slow_answer() -> None:
    """One slow answer in 20 leaves the bound (the objective is a p95); two cut it. A cut empties
    the window, so the next one needs slow answers after it."""
    now = [0.0]
    cfg = _cfg(inflight=20, adaptive=True, min_inflight_per_replica=4)
    flow = Flow(cfg, Capacity(cfg), clock=lambda: now[0])
    for i in range(200):  # one slow answer in every 20: the p95 holds
        now[0] += 0.1
        flow.observe("tiny", 0, 2.0 if i % 20 == 0 else 0.1)
    assert flow.limit("tiny") == 20
    for i in range(40):  # one in every 10: it does not
        now[0] += 0.1
        flow.observe("tiny", 0, 2.0 if i % 10 == 0 else 0.1)
    assert flow.limit("tiny") < 20


def test_the_top_band_passes_a_cut_bound_up_to_the_ceiling() -> None:
    now = [0.0]
    cfg = _cfg(inflight=8, adaptive=True, min_inflight_per_replica=2, target_share=0.5)

    async def go() -> tuple[list[bool], list[bool], list[str]]:
        flow = Flow(cfg, Capacity(cfg), clock=lambda: now[0])
        for _ in range(20):
            now[0] += 1.0
            flow.observe("tiny", 0, 2.0)
        assert flow.limit("tiny") == 2 and flow.top_limit("tiny") == 8
        lower = [_reserve(flow, cfg, "standard", "s") for _ in range(3)]
        top = [_reserve(flow, cfg, "premium", "p") for _ in range(7)]
        granted = [w.granted for w in lower], [w.granted for w in top]
        # A slot freed with both bands waiting: over the bound, only the top band may take it.
        flow.release("tiny")
        await asyncio.sleep(0)
        return *granted, [w.tier for w in (lower[2], top[6]) if w.granted]

    lower, top, granted = run(go)
    assert lower == [True, True, False]  # the cut bound holds the lower band at 2
    assert top == [True] * 6 + [False]  # premium runs up to the ceiling of 8 in flight
    assert granted == ["premium"]


def test_the_engines_ttft_reaches_the_bound_when_a_request_settles() -> None:
    cfg = _cfg(inflight=20, adaptive=True)
    adm = Admission(cfg, MemoryBackend())

    async def go() -> None:
        await adm.queue(await adm.admit(_key("b", "batch"), ["tiny"], {"max_tokens": 8}, 10))
        ticket = await adm.admit(_key("p", "premium"), ["tiny"], {"max_tokens": 8}, 10)
        clock = StageClock(100.0, clock=lambda: 100.0)
        await adm.queue(ticket, clock)
        clock.mark("handle", at=100.1)
        clock.mark("engine", at=101.0)  # 1 s from the handle to the first token: over 0.5 s
        await adm.settle(ticket, 10)

    run(go)
    assert adm.flow.limit("tiny") == 20  # one slow answer of the top tier is not its p95
    run(go)
    assert adm.flow.limit("tiny") == 16  # two of its last 20 are


def test_queue_off_admits_as_before() -> None:
    cfg = _cfg(enabled=False)
    adm = Admission(cfg, MemoryBackend())

    async def go() -> None:
        tickets = [await adm.admit(_key("p", "premium"), ["tiny"], {"max_tokens": 8}, 10)
                   for _ in range(10)]
        for t in tickets:
            await adm.queue(t)  # nothing to wait for
        assert adm.inflight["tiny"] == 10 and adm.flow.snapshot() == {}
        for t in tickets:
            await adm.settle(t, 1)
        assert adm.inflight["tiny"] == 0

    run(go)


def test_a_full_queued_primary_overflows_onto_a_fallback_with_room() -> None:
    cfg = AppConfig.model_validate({
        "models": [
            {"id": "tiny", "source": "builtin:tiny-chat", "fallback": "spare",
             "flow": {"enabled": True, "max_inflight_per_replica": 1}},
            {"id": "spare", "source": "builtin:tiny-chat"},
        ],
    })
    adm = Admission(cfg, MemoryBackend())

    async def go() -> list[str]:
        key = _key("s")
        tickets = [await adm.admit(key, ["tiny", "spare"], {"max_tokens": 8}, 10) for _ in range(3)]
        return [t.model_id for t in tickets]

    assert run(go) == ["tiny", "spare", "spare"]


def _http(tmp_path: Path, enabled: bool = True) -> tuple[TestClient, GatewayDeps, str]:
    """The gateway's real API and pipeline over a fake model, with tiny-chat's queue on."""
    keys_file = tmp_path / "keys.yaml"
    key = create_key(keys_file, "k", "premium", ["*"])
    app_config = {
        "models": [{"id": "tiny-chat", "source": "builtin:tiny-chat",
                    "flow": {"enabled": enabled, "max_inflight_per_replica": 1}}],
        "gateway": {"keys": {"file": str(keys_file)}, "http": {"retry_after_s": 3}},
        "tiers": {"premium": {"priority": 0, "max_queue_wait_s": 0.05}},
        "default_tier": "premium",
    }
    models = FakeModels()
    deps = _gateway_deps(app_config, {"tiny-chat": models.handle("tiny-chat")})
    return TestClient(build_api(deps), raise_server_exceptions=False), deps, key


CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_the_queue_wait_is_a_stage_in_server_timing(tmp_path: Path) -> None:
    client, _, key = _http(tmp_path)
    with client:
        resp = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 200, resp.text
    stages = [part.split(";")[0].strip() for part in resp.headers["server-timing"].split(",")]
    assert stages[stages.index("admission") + 1] == "queue"


def test_a_request_that_waits_too_long_gets_the_openai_503_over_http(tmp_path: Path) -> None:
    client, deps, key = _http(tmp_path)
    adm = deps.pipeline.admission
    with client:
        holder = client.portal.call(adm.admit, KeyRecord(id="other", digest=DIGEST, tier="premium"),
                                    ["tiny-chat"], {"max_tokens": 4}, 10)  # holds the one slot
        resp = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 503, resp.text
        assert 3 <= int(resp.headers["retry-after"]) <= 6  # an overload's wait: 3 s, jittered
        assert resp.json()["error"]["code"] == "queue_timeout"
        assert "waited 0.05 s at the gateway" in resp.json()["error"]["message"]
        assert adm.inflight["tiny-chat"] == 1
        client.portal.call(adm.settle, holder, 1)
        assert adm.inflight["tiny-chat"] == 0
        usage = client.get("/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()
    assert "queue_timeout" in json.dumps(usage)


def test_diagnose_shows_the_queue() -> None:
    cfg = _cfg(inflight=1)

    async def go() -> dict[str, Any]:
        flow = _flow(cfg)
        _reserve(flow, cfg, "premium", "p")
        _reserve(flow, cfg, "batch", "noisy")
        _reserve(flow, cfg, "batch", "noisy")
        _reserve(flow, cfg, "batch", "quiet")
        return flow.snapshot()

    lines = flow_lines(run(go))
    assert lines == ["flow queue tiny: 1 in flight of 1, 3 waiting; "
                     "batch: noisy 2, quiet 1 (oldest 0.0 s)"]


def test_without_a_queue_the_queue_stage_is_not_marked(tmp_path: Path) -> None:
    client, _, key = _http(tmp_path, enabled=False)
    with client:
        resp = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
    assert resp.status_code == 200, resp.text
    assert "queue;" not in resp.headers["server-timing"]


def test_the_adaptive_floor_is_a_quarter_of_the_ceiling_by_default() -> None:
    cfg = _cfg(inflight=64, adaptive=True, min_inflight_per_replica=None)
    now = [0.0]
    flow = Flow(cfg, Capacity(cfg), clock=lambda: now[0])
    for _ in range(40):
        now[0] += 1.0
        flow.observe("tiny", 0, 5.0)
    assert flow.limit("tiny") == 16


def test_the_bound_recovers_on_any_tiers_fast_answers_while_requests_wait() -> None:
    cfg = _cfg(inflight=20, adaptive=True, min_inflight_per_replica=4)
    now = [0.0]
    flow = Flow(cfg, Capacity(cfg), clock=lambda: now[0])
    for _ in range(20):
        now[0] += 1.0
        flow.observe("tiny", 0, 2.0)
    assert flow.limit("tiny") == 4

    async def go() -> None:
        for _ in range(10):
            _reserve(flow, cfg, "batch", "b")  # only batch now, and some of it waits
        for _ in range(200):
            flow.observe("tiny", 10, 0.1)

    run(go)
    assert flow.limit("tiny") == 20


def test_the_lower_bands_leave_the_engines_reserved_slots_to_the_top_tier() -> None:
    cfg = _cfg(inflight=8, reserved=3)
    flow = _flow(cfg)
    assert flow.limit("tiny") == 5 and flow.top_limit("tiny") == 8

    async def go() -> tuple[list[bool], list[bool]]:
        lower = [_reserve(flow, cfg, "batch", "b") for _ in range(6)]
        top = [_reserve(flow, cfg, "premium", "p") for _ in range(3)]
        return [w.granted for w in lower], [w.granted for w in top]

    lower, top = run(go)
    assert lower == [True] * 5 + [False]  # batch stops at 8 - 3
    assert top == [True] * 3  # premium finds the reserve free at once


def test_a_top_tier_request_that_waits_for_a_slot_cuts_the_lower_bands_bound() -> None:
    now = [0.0]
    cfg = _cfg(inflight=10, adaptive=True, min_inflight_per_replica=2)
    flow = Flow(cfg, Capacity(cfg), clock=lambda: now[0])

    async def go() -> list[bool]:
        lower = [_reserve(flow, cfg, "batch", "b") for _ in range(10)]  # every slot taken
        top = _reserve(flow, cfg, "premium", "p")
        assert not top.granted
        now[0] += 0.01  # a short wait (under TOP_WAIT_CUT of 1 s) cuts nothing
        flow.release("tiny")
        assert top.granted and flow.limit("tiny") == 10
        late = _reserve(flow, cfg, "premium", "p")
        now[0] += 0.2
        flow.release("tiny")
        return [late.granted, *(w.granted for w in lower)]

    granted = run(go)
    assert granted[0]
    assert flow.limit("tiny") == 8  # cut by a fifth: batch gets fewer slots, premium more


def test_a_tier_waits_three_objectives_by_default() -> None:
    cfg = AppConfig.model_validate({"tiers": {"premium": {"priority": 0, "objectives": {"ttft_p95_ms": 1000}},
                                              "batch": {"priority": 10, "max_queue_wait_s": 2.5}},
                                    "default_tier": "premium", "models": [{"id": "m", "source": "builtin:tiny-chat"}]})
    assert cfg.tiers["premium"].queue_wait_s == 3.0
    assert cfg.tiers["batch"].queue_wait_s == 2.5


def test_the_bound_is_back_at_its_ceiling_once_the_top_tier_is_quiet() -> None:
    now = [0.0]
    cfg = _cfg(inflight=20, adaptive=True, min_inflight_per_replica=4)
    flow = Flow(cfg, Capacity(cfg), clock=lambda: now[0])
    for _ in range(20):
        now[0] += 1.0
        flow.observe("tiny", 0, 2.0)  # premium's first tokens are slow: cut to the floor
    assert flow.limit("tiny") == 4
    now[0] += 4.9  # premium quiet for under 5 objectives (1 s each): the cut stands
    assert flow.limit("tiny") == 4
    now[0] += 0.2
    assert flow.limit("tiny") == 20  # quiet for 5.1: back at the ceiling
