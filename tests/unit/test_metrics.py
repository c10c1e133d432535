"""GatewayMetrics: buckets hold every tier objective; goodput, rejections and statuses are counted."""

from __future__ import annotations

from typing import Any

import pytest

from serve_app import metrics
from serve_app.config import AppConfig
from serve_app.metrics import GatewayMetrics, objective_buckets
from tests.unit.builders import shipped_args, shipped_config


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[float, dict[str, str]]] = []

    def inc(self, value: float = 1, tags: dict[str, str] | None = None) -> None:
        self.calls.append((value, dict(tags or {})))

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.calls.append((value, dict(tags or {})))


def _fake() -> GatewayMetrics:
    return GatewayMetrics(*(_Recorder() for _ in range(7)))  # type: ignore[arg-type]


def test_every_tier_objective_is_a_bucket_boundary() -> None:
    cfg = shipped_config()
    ttft, tpot = objective_buckets(cfg)
    for tier in cfg.tiers.values():
        assert tier.objectives.ttft_p95_ms / 1000 in ttft
        assert tier.objectives.tpot_p95_ms / 1000 in tpot
    # 15 s TTFT and 0.15 s / 0.3 s TPOT were missing from the fixed lists (issue 13).
    assert {15.0} <= set(ttft) and {0.15, 0.3} <= set(tpot)
    assert ttft == sorted(set(ttft)) and tpot == sorted(set(tpot))


def test_a_new_objective_gets_its_bucket() -> None:
    doc = shipped_args()
    doc["tiers"]["gold"] = {"priority": 1, "objectives": {"ttft_p95_ms": 777, "tpot_p95_ms": 42}}
    ttft, tpot = objective_buckets(AppConfig.model_validate(doc))
    assert 0.777 in ttft and 0.042 in tpot


def test_without_config_the_base_buckets_remain() -> None:
    assert objective_buckets(None) == (metrics.LATENCY_BUCKETS_S, metrics.TPOT_BUCKETS_S)


def test_create_passes_objective_buckets_to_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    made: dict[str, Any] = {}

    class Hist:
        def __init__(self, name: str, description: str, boundaries: list[float], tag_keys: Any) -> None:
            made[name] = boundaries

    class Ctr:
        def __init__(self, name: str, description: str, tag_keys: Any) -> None:
            made[name] = tag_keys

    monkeypatch.setattr(metrics, "Histogram", Hist)
    monkeypatch.setattr(metrics, "Counter", Ctr)
    GatewayMetrics.create(shipped_config())
    assert 15.0 in made["serve_app_ttft_seconds"] and 0.15 in made["serve_app_tpot_seconds"]
    assert made["serve_app_goodput_total"] == ("key_id", "tier", "model")


def _finish(m: GatewayMetrics, status: int = 200, missed: tuple[str, ...] = ()) -> None:
    m.request_finished(key_id="k", tier="premium", model="tiny-chat", status=status,
                       prompt_tokens=5, completion_tokens=7, ttft_s=0.2, tpot_s=0.01, missed=missed)


def test_goodput_counts_only_successes_that_met_every_objective() -> None:
    m = _fake()
    _finish(m)
    _finish(m, missed=("ttft",))
    _finish(m, status=500)
    assert len(m.goodput.calls) == 1  # type: ignore[attr-defined]
    assert m.goodput.calls[0][1] == {"key_id": "k", "tier": "premium", "model": "tiny-chat"}  # type: ignore[attr-defined]
    statuses = [t["status"] for _, t in m.requests.calls]  # type: ignore[attr-defined]
    assert statuses == ["200", "200", "500"]
    assert [t["objective"] for _, t in m.slo_misses.calls] == ["ttft"]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("reason", "status"), [("rate_limit", "429"), ("shed", "503"),
                                                 ("backpressure", "503")])
def test_rejection_counts_its_reason_and_its_status(reason: str, status: str) -> None:
    m = _fake()
    m.request_rejected(key_id="k", tier="batch", model="tiny-chat", reason=reason)
    assert m.rejections.calls == [(1, {"key_id": "k", "tier": "batch", "model": "tiny-chat",  # type: ignore[attr-defined]
                                       "reason": reason})]
    assert m.requests.calls[0][1]["status"] == status  # type: ignore[attr-defined]
    assert not m.goodput.calls  # type: ignore[attr-defined]


def test_declared_series_include_histogram_parts_and_ray_prefix() -> None:
    names = metrics.declared_series()
    assert "ray_serve_app_ttft_seconds_bucket" in names
    assert "ray_vllm_time_to_first_token_seconds_bucket" in names
    assert "ray_serve_app_goodput_total" in names
    assert not any(n.startswith("serve_app_") for n in names)
