"""Admission: a model's capacity and its tiers' shedding hold under a burst, with a slow counter backend."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from serve_app import errors
from serve_app.config import AppConfig, KeyRecord, ModelConfig
from serve_app.gateway.admission.admission import Admission
from serve_app.state.limits import Charge, MemoryBackend, Verdict

DIGEST = "sha256:" + "0" * 64


def _cfg(gateway_replicas: int = 1, premium_rpm: int | None = None,
         **tiny_deployment: Any) -> AppConfig:
    return AppConfig.model_validate({
        "tiers": {
            "premium": {"priority": 0, "shed_at": 1.0, "key_limits": {"rpm": premium_rpm}},
            "batch": {"priority": 10, "shed_at": 0.5},
        },
        "default_tier": "premium",
        "gateway": {"num_replicas": gateway_replicas},
        "models": [
            {"id": "tiny", "source": "builtin:tiny-chat", "fallback": "spare",
             "deployment": {"num_replicas": 1, "max_ongoing_requests": 4, "max_queued_requests": 2,
                            **tiny_deployment},
             "admission": {"saturation_requests": 6}},
            {"id": "spare", "source": "builtin:tiny-chat",
             "deployment": {"num_replicas": 1, "max_ongoing_requests": 1, "max_queued_requests": 1}},
        ],
    })


PREMIUM = KeyRecord(id="p", digest=DIGEST, tier="premium")
BATCH = KeyRecord(id="b", digest=DIGEST, tier="batch")


class SlowBackend(MemoryBackend):
    """A counter backend that answers after a delay, like Redis under load."""

    async def admit(self, charges: list[Charge], now: float) -> Verdict:
        await asyncio.sleep(0.01)
        return await super().admit(charges, now)


def _burst(adm: Admission, key: KeyRecord, n: int, models: list[str]) -> list[Any]:
    async def one() -> Any:
        try:
            return await adm.admit(key, models, {"max_tokens": 8}, 100)
        except errors.ServeAppError as exc:
            return exc

    async def run() -> list[Any]:
        return await asyncio.gather(*[one() for _ in range(n)])

    return asyncio.run(run())


def test_capacity_is_ongoing_times_replicas_plus_queue() -> None:
    m = _cfg().models[0]
    assert m.deployment.capacity == 4 * 1 + 2
    scaled = ModelConfig.model_validate({
        "id": "x", "source": "builtin:tiny-chat",
        "deployment": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3},
                       "max_ongoing_requests": 8, "max_queued_requests": 5},
    })
    assert scaled.deployment.capacity == 8 * 3 + 5
    unbounded = ModelConfig.model_validate({"id": "y", "source": "builtin:tiny-chat"})
    assert unbounded.deployment.capacity is None


def test_a_burst_never_passes_capacity_even_with_a_slow_backend() -> None:
    adm = Admission(_cfg(), SlowBackend())
    results = _burst(adm, PREMIUM, 20, ["tiny"])
    admitted = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, Exception)]
    assert len(admitted) == 6 and adm.inflight["tiny"] == 6
    # The top tier is never shed, only refused at capacity.
    assert all(type(r) is errors.Overloaded for r in refused)
    assert "at capacity" in refused[0].message and refused[0].headers["Retry-After"]


def test_the_lower_tier_is_shed_at_its_share_of_saturation() -> None:
    adm = Admission(_cfg(), SlowBackend())
    results = _burst(adm, BATCH, 10, ["tiny"])
    assert sum(not isinstance(r, Exception) for r in results) == 3  # 0.5 x 6
    assert all(isinstance(r, errors.Shed) for r in results if isinstance(r, Exception))
    # Premium still gets in up to the capacity.
    more = _burst(adm, PREMIUM, 10, ["tiny"])
    assert sum(not isinstance(r, Exception) for r in more) == 3


def test_each_replica_counts_its_share_of_the_whole() -> None:
    adm = Admission(_cfg(gateway_replicas=2), MemoryBackend())
    results = _burst(adm, PREMIUM, 10, ["tiny"])
    assert sum(not isinstance(r, Exception) for r in results) == 3  # 6 across 2 replicas


def test_a_full_primary_overflows_onto_its_fallback() -> None:
    adm = Admission(_cfg(), SlowBackend())
    results = _burst(adm, PREMIUM, 10, ["tiny", "spare"])
    placed = [r.model_id for r in results if not isinstance(r, Exception)]
    assert placed.count("tiny") == 6 and placed.count("spare") == 2
    # Both full: the primary's refusal is what the client sees.
    assert all("'tiny' is at capacity" in r.message for r in results if isinstance(r, Exception))


def test_a_rate_limited_request_gives_its_slot_back() -> None:
    adm = Admission(_cfg(premium_rpm=2), SlowBackend())
    results = _burst(adm, PREMIUM, 5, ["tiny"])
    refused = [r for r in results if isinstance(r, Exception)]
    assert [type(r) for r in refused] == [errors.RateLimited] * 3
    assert adm.inflight["tiny"] == 2
    # The 429 names the limit, its scope and tier, and how to get a higher one.
    msg = refused[0].message
    assert "requests per minute (2)" in msg and "'premium'" in msg and "higher limit" in msg


def test_settle_and_move_keep_the_counts_right() -> None:
    adm = Admission(_cfg(), MemoryBackend())

    async def run() -> None:
        t = await adm.admit(PREMIUM, ["tiny"], {"max_tokens": 8}, 10)
        adm.move(t, PREMIUM, "spare")
        assert (t.model_id, adm.inflight["tiny"], adm.inflight["spare"]) == ("spare", 0, 1)
        other = await adm.admit(PREMIUM, ["spare"], {"max_tokens": 8}, 10)
        third = await adm.admit(PREMIUM, ["tiny"], {"max_tokens": 8}, 10)
        with pytest.raises(errors.ServiceUnavailable):
            adm.move(third, PREMIUM, "spare")  # spare holds 2 of 2
        assert third.model_id == "tiny" and adm.inflight["tiny"] == 1
        for ticket in (t, other, third):
            await adm.settle(ticket, 10)
            await adm.settle(ticket, 10)  # twice is a no-op
        assert adm.inflight["tiny"] == 0 and adm.inflight["spare"] == 0

    asyncio.run(run())
