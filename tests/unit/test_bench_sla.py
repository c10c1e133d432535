"""loadtests.bench.sla's pure parts: the agreement rule, verdicts, window math, PromQL, the tables,
and the open-loop schedule of the light client."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from loadtests.bench import sla
from loadtests.harness.stack import Stack
from loadtests.sla import Objective

OBJ = {"premium": Objective(1000, 150, 0), "standard": Objective(2500, 300, 5),
       "batch": Objective(15000, 1000, 10)}


@pytest.mark.parametrize(("value", "ref", "ok"), [
    (212, 1013, False),  # the premium: Prometheus 212 ms, the client 1,013 ms
    (1100, 1000, True),  # 10 %
    (1200, 1000, True),  # 20 % exactly
    (1201, 1000, False),
    (150, 60, True),  # 90 ms apart: the 100 ms floor applies below 500 ms
    (161, 60, False),
    (5900, 5000, True),  # 18 %: the relative rule is the larger one above 500 ms
    (None, 1000, None),
    (1000, None, None),
])
def test_agreement_is_20_percent_or_100_ms_whichever_is_larger(value: float | None, ref: float | None,
                                                               ok: bool | None) -> None:
    assert sla.agrees(value, ref) is ok


def test_verdict_judges_ttft_and_tpot_like_locust() -> None:
    o = OBJ["premium"]
    assert sla.verdict(999, 150, o) == "PASS"
    assert sla.verdict(1001, 10, o) == "FAIL"
    assert sla.verdict(100, 151, o) == "FAIL"
    assert sla.verdict(None, 10, o) == sla.verdict(10, None, o) == "NO DATA"


def test_window_covers_the_load_and_one_scrape_before_it() -> None:
    assert sla.window_seconds(1000.0, 1145.2) == 151  # 145.2 + 5, rounded up
    assert sla.window_seconds(1000.0, 1001.0, lead_s=0) == 1
    with pytest.raises(ValueError):
        sla.window_seconds(1000.0, 1000.0)


def test_promql_strings() -> None:
    q = sla.Queries(150)
    assert q.ttft_p95 == ('histogram_quantile(0.95, sum by (le, tier) '
                          '(rate(ray_serve_app_ttft_seconds_bucket{model="tiny-chat"}[150s])))')
    assert q.tpot_p95.startswith("histogram_quantile(0.95, sum by (le, tier) (rate(ray_serve_app_tpot_seconds_bucket")
    assert q.stage_mean == (
        'sum by (tier, stage) (increase(ray_serve_app_stage_seconds_sum{model="tiny-chat"}[150s])) / '
        'sum by (tier, stage) (increase(ray_serve_app_stage_seconds_count{model="tiny-chat"}[150s]))')
    assert "sum by (le, tier, stage)" in q.stage_p95
    assert q.vllm_ttft_p95 == ("histogram_quantile(0.95, sum by (le, model_name) "
                               "(rate(ray_vllm_time_to_first_token_seconds_bucket[150s])))")
    assert q.cpu_seconds == ("sum by (kind, deployment) "
                             "(increase(ray_serve_app_process_cpu_seconds_total[150s]))")
    assert q.loop_lag_max == ("max by (kind, deployment) "
                              "(max_over_time(ray_serve_app_event_loop_lag_seconds[150s]))")
    assert q.completion_tokens == 'sum(increase(ray_serve_app_tokens_total{type="completion"}[150s]))'
    assert q.requests == 'sum by (tier) (increase(ray_serve_app_ttft_seconds_count{model="tiny-chat"}[150s]))'


def test_argument_parsing() -> None:
    assert sla.parse_users("12,24") == [12, 24]
    assert [sla.parse_duration(x) for x in ("120", "120s", "2m", "1h")] == [120, 120, 120, 3600]
    for bad in ("", "0", "12,-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            sla.parse_users(bad)
    for bad in ("0", "2d", "-5", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            sla.parse_duration(bad)
    ns = sla.parse_args([])
    assert (ns.users, ns.duration, ns.spawn_rate, ns.client_interval) == ([12], 120, 4, 0.5)


def test_percentiles_interpolate_between_order_statistics() -> None:
    assert sla.percentile([], 0.95) is None
    assert sla.percentile([7.0], 0.95) == 7.0
    assert sla.percentile(list(map(float, range(1, 101))), 0.95) == pytest.approx(95.05)
    assert sla.summary([3.0, 1.0, 2.0]) == {"n": 3, "p50_ms": 2.0, "p95_ms": 2.9, "max_ms": 3.0}


def test_server_timing_header() -> None:
    assert sla.parse_server_timing('front_door;dur=1.2, parse_auth;desc="x";dur=0.3, miss, total;dur=5') == {
        "front_door": 1.2, "parse_auth": 0.3, "total": 5.0}
    assert sla.parse_server_timing("") == {}
    assert sla.parse_server_timing("a;dur=oops") == {}


def test_stages_in_request_order_unknown_last() -> None:
    assert sla.ordered_stages(["relay", "zeta", "front_door", "engine", "alpha"]) == [
        "front_door", "engine", "relay", "alpha", "zeta"]


def test_prometheus_vectors_by_label() -> None:
    result = [{"metric": {"tier": "premium", "stage": "engine"}, "value": [0, "0.25"]},
              {"metric": {"tier": "batch", "stage": "engine"}, "value": [0, "NaN"]}]
    flat = sla.by_label(result, "tier", "stage", scale=1000)
    assert flat == {"premium / engine": 250.0}
    assert sla.nested(flat) == {"premium": {"engine": 250.0}}


def _level() -> dict[str, Any]:
    return {
        "users": 12, "spawn_rate": 4, "duration_s": 120, "client_interval_s": 0.5, "window_s": 150,
        "locust_exit": 1,
        "locust": {"duration_s": 120.4, "output_tokens_per_s": 900.0, "tiers": [
            {"tier": "premium", "requests": 100, "errors": 0, "ttft_p95_ms": 1500.0, "tpot_p95_ms": 40.0,
             "status": "FAIL"},
            {"tier": "standard", "requests": 200, "errors": 0, "ttft_p95_ms": 1400.0, "tpot_p95_ms": 40.0,
             "status": "PASS"}]},
        "client": {"ttft": sla.summary([100.0, 150.0, 1013.0]), "head": sla.summary([80.0]), "errors": 0,
                   "server_timing_mean_ms": {"front_door": 3.0, "parse_auth": 0.4, "total": 9.0}},
        "health": {**sla.summary([5.0, 6.0, 700.0]), "errors": 0},
        "prometheus": {
            "ttft_p95_ms": {"premium": 212.0, "standard": 1300.0}, "tpot_p95_ms": {"premium": 40.0,
                                                                                  "standard": 50.0},
            "requests": {"premium": 340.0, "standard": 200.0},
            "stage_mean_ms": {"premium": {"front_door": 300.0, "engine": 80.0}},
            "stage_p95_ms": {"premium": {"front_door": 900.0}},
            "vllm_ttft_p95_ms": {"tiny-chat": 137.0},
            "cpu_seconds": {"gateway / gateway": 60.0, "model / model-tiny-chat": 100.0},
            "loop_lag_max_ms": {"gateway / gateway": 40.0}, "completion_tokens": 50000.0}}


def test_tier_rows_compare_each_source() -> None:
    rows = {r["tier"]: r for r in sla.tier_rows(_level(), OBJ)}
    p, s, b = rows["premium"], rows["standard"], rows["batch"]
    assert (p["locust_verdict"], p["prom_verdict"], p["verdicts_equal"]) == ("FAIL", "PASS", False)
    assert p["client_ttft_p95_ms"] == pytest.approx(926.7, abs=0.1)
    assert (p["prom_vs_client"], p["prom_vs_locust"]) == (False, False)
    assert (s["client_ttft_p95_ms"], s["prom_vs_client"], s["prom_vs_locust"], s["verdicts_equal"]) == (
        None, None, True, True)
    assert (b["locust_verdict"], b["prom_verdict"], b["verdicts_equal"]) == ("NO DATA", "NO DATA", None)


def test_markdown_tables() -> None:
    doc = {"command": "python -m loadtests.bench.sla", "config": "configs/local.yaml", "export_delay_s": 25,
           "objectives": {t: {"ttft_p95_ms": o.ttft_p95_ms, "tpot_p95_ms": o.tpot_p95_ms,
                              "priority": o.priority} for t, o in OBJ.items()},
           "levels": [_level()]}
    md = sla.markdown(doc)
    assert "### -u 12 -r 4, 120 s (Prometheus window 150 s)" in md
    assert "| premium | 1000 / 150 | 1500 | FAIL | 927 | 212 | 40 | PASS | NO | NO | NO | 100 / 340 |" in md
    assert "| standard | 2500 / 300 | 1400 | PASS | - | 1300 | 50 | PASS | - | yes | yes | 200 / 200 |" in md
    assert "| batch | 15000 / 1000 | - | NO DATA | - | - | - | NO DATA | - | - | - | - / - |" in md
    assert "p50 6 / p95 631 / max 700 ms" in md  # /health
    assert "tiny-chat 137 ms" in md
    assert "| Tier | front_door | parse_auth | engine | sum of means |" in md
    assert "| premium | 300.0 (900) | - (-) | 80.0 (-) | 380.0 |" in md
    assert "| premium, client's Server-Timing (mean) | 3.0 | 0.4 | - | 3.4 |" in md
    assert "| gateway / gateway | 60.0 | 0.50 | 40 |" in md
    assert "Gateway CPU per 1,000 completion tokens: 1.20 s" in md
    assert "Locust ran 120 s (exit 1)" in md


def test_markdown_without_prometheus_data_says_so() -> None:
    level = {**_level(), "prometheus": {}, "client": {}, "locust": {}}
    md = sla.markdown({"command": "x", "config": "c", "export_delay_s": 25, "levels": [level],
                       "objectives": {"premium": {"ttft_p95_ms": 1000, "tpot_p95_ms": 150, "priority": 0}}})
    assert "Stages: no data" in md and "CPU: no" in md
    assert "| premium | 1000 / 150 | - | NO DATA |" in md


def test_locust_runs_the_readme_example(tmp_path: Path) -> None:
    stack = cast(Stack, SimpleNamespace(root_url="http://127.0.0.1:9", config=tmp_path / "serve.yaml"))
    argv = sla.locust_argv(stack, 12, 4, 120, tmp_path / "sla.json")
    joined = " ".join(argv)
    assert "-f " + str(sla.LOCUSTFILE) in joined
    assert "--headless -u 12 -r 4 -t 120s" in joined
    assert f"--app-config {tmp_path / 'serve.yaml'}" in joined and f"--sla-json {tmp_path / 'sla.json'}" in joined
    assert "--mix" not in argv and "--max-output-tokens" not in argv  # the README's defaults


def test_schedule_is_open_loop_and_bounded() -> None:
    """A request slower than the interval does not delay the next one; one that overruns its
    timeout counts as an error; the loop ends promptly once stopped."""
    started: list[float] = []
    errors: list[BaseException] = []

    async def slow() -> None:
        started.append(time.monotonic())
        await asyncio.sleep(0.3)  # longer than both the interval and the timeout

    async def go() -> float:
        stop = asyncio.Event()
        task = asyncio.create_task(sla.every(0.02, stop, slow, 0.1, errors.append))
        await asyncio.sleep(0.2)
        stop.set()
        t = time.monotonic()
        await task
        return time.monotonic() - t

    waited = asyncio.run(go())
    assert len(started) >= 6  # ~10 at 0.02 s in 0.2 s despite each taking 0.3 s
    assert errors and all(isinstance(e, TimeoutError) for e in errors)
    assert len(errors) == len(started)
    assert waited < 0.5


def test_a_small_samples_p95_is_an_interval_of_order_statistics() -> None:
    assert sla.quantile_interval(list(range(1, 101)), 0.5) == (40, 61)  # the textbook interval for n = 100
    assert sla.quantile_interval(list(range(1, 48)), 0.95) == (41, 47)  # 47 requests: 41st to the largest
    assert sla.quantile_interval(list(range(1, 1001)), 0.95) == (936, 964)
    assert sla.quantile_interval([], 0.95) is None
    # CI's case: Prometheus (every request) 886 ms, the light client's 47 requests p95 680 ms with its
    # largest near locust's p95: within the sample's interval, so they agree.
    sample = [300.0] * 40 + [600.0, 650.0, 680.0, 700.0, 760.0, 820.0, 905.0]
    assert sla.agrees_with_sample(886.0, sample)
    assert not sla.agrees_with_sample(2000.0, sample)  # far past the sample's largest and the tolerance
    assert not sla.agrees_with_sample(100.0, sample)
