"""serve_app.engine.sim: the simulated replica's metrics are the real engine's ray_vllm_* series,
and its scaled clock keeps modelled time without a wake-up per short step."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from serve_app.engine.sim import stats
from serve_app.engine.sim.engine import ScaledClock, StepReport
from serve_app.engine.sim.scheduler import SimRequest
from serve_app.metrics import ENGINE_METRICS


class FakeMetric:
    made: dict[str, FakeMetric] = {}

    def __init__(self, name: str, description: str = "", tag_keys: tuple[str, ...] = (),
                 boundaries: list[float] | None = None) -> None:
        self.name, self.tag_keys, self.values = name, tag_keys, []
        FakeMetric.made[name] = self

    def observe(self, value: float, tags: dict[str, str]) -> None:
        assert sorted(tags) == sorted(self.tag_keys)
        self.values.append(value)

    inc = observe  # a Counter's and a Gauge's (``set``) methods record alike here


setattr(FakeMetric, "set", FakeMetric.observe)  # noqa: B010 - "set" would shadow the builtin in the class


def test_every_engine_series_is_made_under_vllms_name_with_vllms_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.util.metrics as ray_metrics

    for kind in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(ray_metrics, kind, FakeMetric)
    FakeMetric.made.clear()
    sink = stats.RayEngineStats("m", "replica-1")
    # Every series the real engine exports, less its LoRA one: the simulated engine serves no adapters.
    assert {"ray_" + n for n in FakeMetric.made} == set(ENGINE_METRICS) - {"ray_vllm_lora_requests_info"}
    done = SimRequest("r", [1, 2, 3], 3, arrival=1.0)
    done.outputs, done.first_token_at, done.finished_at = [7, 8, 9], 1.5, 2.5
    sink.step(StepReport(running=2, waiting=1, kv_usage=0.25, prompt_tokens=3, generation_tokens=4,
                         cache_queries=100, cache_hits=64, preemptions=1, ttfts=[0.5],
                         itls=[0.02, 0.03], finished=[done]))
    got: dict[str, Any] = {"ray_" + n: m.values for n, m in FakeMetric.made.items()}
    assert got["ray_vllm_prefix_cache_hits_total"] == [64]
    assert got["ray_vllm_kv_cache_usage_perc"] == [0.25]
    assert got["ray_vllm_request_time_per_output_token_seconds"] == [0.5]  # (2.5 - 1.5) / 2
    assert got["ray_vllm_e2e_request_latency_seconds"] == [1.5]
    assert got["ray_vllm_request_success_total"] == [1]


def test_the_scaled_clock_runs_modelled_time_faster_and_owes_short_steps() -> None:
    async def main() -> tuple[float, float, float]:
        clock = ScaledClock(time_scale=10.0, quantum_s=0.01)
        loop = asyncio.get_running_loop()
        clock.now()
        t0 = loop.time()
        for _ in range(100):
            await clock.sleep(0.005)  # 0.5 ms of wall each: slept in ten 5 ms lumps
        return loop.time() - t0, clock.now(), clock._due - loop.time()

    wall, modelled, owed = asyncio.run(main())
    assert 0.04 <= wall < 0.5 and owed < 0.01  # 100 x 5 ms modelled / 10 = 50 ms of wall
    assert modelled == pytest.approx(wall * 10, rel=0.01)


def test_a_busy_engine_does_not_add_the_loop_s_own_time_to_its_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    slept: list[float] = []

    async def fake_sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    clock = ScaledClock(time_scale=1.0, quantum_s=0.001)
    monkeypatch.setattr(clock, "_loop_time", lambda: now[0])
    monkeypatch.setattr("serve_app.engine.sim.engine.asyncio.sleep", fake_sleep)

    async def main() -> None:
        clock.idle()
        for _ in range(10):
            await clock.sleep(0.01)
            now[0] += 0.004  # 4 ms of Python between steps (completing, scheduling)

    asyncio.run(main())
    assert now[0] == pytest.approx(0.104)  # ten 10 ms steps back to back, not 140 ms
    assert slept[1:] == pytest.approx([0.006] * 9)
    clock.idle()
    now[0] += 0.05  # idle: not credited to the next step
    asyncio.run(clock.sleep(0.01))
    assert slept[-1] == pytest.approx(0.01)
    now[0] += 1.0  # an overloaded loop's long stall is dropped, not made up in a burst
    asyncio.run(clock.sleep(0.01))
    assert slept[-1] == pytest.approx(0.01)
