"""The fleet fairness scenario's pure parts (loadtests/bench/fleet_fairness.py): the fleet's
capacity and the users of each phase, the tiers' objectives in wall time, the prompts, the window,
each key's figures, Jain over max-min fair shares and the verdicts."""

from __future__ import annotations

import pytest

from loadtests.bench import fleet
from loadtests.bench.fleet_fairness import (
    CHARS_PER_TOKEN,
    capacity,
    fair_jain,
    in_window,
    key_figures,
    make_prompts,
    rejections_by_tier,
    scaled_tiers,
    users_for,
    verdict,
)
from loadtests.bench.loadgen import Sample


def test_capacity_leaves_the_top_tiers_reserve_to_it() -> None:
    assert capacity(4, 64, 8, top_tier=False) == 224
    assert capacity(4, 64, 8, top_tier=True) == 256


def test_the_noisy_key_sends_ten_times_a_quiet_key_at_twice_the_capacity() -> None:
    quiet, noisy = users_for(224, 2, 1.0)
    assert quiet == 25  # a fair share: 224 / 9
    assert noisy == 448 - 8 * 25 == 248  # ~10x a quiet key
    assert users_for(224, 4, 1.0) == (25, 696)
    assert users_for(224, 0, 1.0) == (25, 0)  # solo: the quiet keys alone, the same users
    assert users_for(224, 2, 0.5)[0] == 12


def test_tiers_objectives_are_divided_by_the_time_scale() -> None:
    tiers = {"premium": {"priority": 0, "objectives": {"ttft_p95_ms": 1000, "tpot_p95_ms": 150}},
             "batch": {"priority": 10, "objectives": {"ttft_p95_ms": 15000}, "max_queue_wait_s": 3}}
    got = scaled_tiers(tiers, 0.1)
    assert got["premium"]["objectives"] == {"ttft_p95_ms": 10000, "tpot_p95_ms": 1500}
    assert got["batch"]["max_queue_wait_s"] == pytest.approx(30)
    assert tiers["premium"]["objectives"]["ttft_p95_ms"] == 1000  # the input is left alone


def test_prompts_are_reproducible_distinct_and_of_their_size() -> None:
    a, b = make_prompts(3, 200, 512, 128), make_prompts(3, 200, 512, 128)
    assert a == b
    assert len({p.text for p in a}) == 200
    assert all(256 <= len(p.text) / CHARS_PER_TOKEN <= 768 and 64 <= p.max_tokens <= 192 for p in a)
    assert make_prompts(4, 10, 512, 128) != a[:10]


def _s(key: str, start: float, status: int = 200, ttft: float | None = 100.0, tokens: int = 10,
       queue: float | None = None, tier: str = "standard") -> Sample:
    return Sample(key, tier, start, start + 1, status, ttft, tokens,
                  {"queue": queue} if queue is not None else {})


def test_window_keeps_the_requests_that_started_in_it() -> None:
    xs = [_s("a", t) for t in (0.0, 5.0, 9.9, 10.0)]
    assert [s.start for s in in_window(xs, 5.0, 10.0)] == [5.0, 9.9]


def test_key_figures_are_in_modelled_time_with_goodput_within_the_objective() -> None:
    xs = [_s("a", 0, ttft=100.0 * (i + 1), queue=10.0) for i in range(20)] + [_s("a", 0, status=503, ttft=None)]
    f = key_figures(xs, window_s=100.0, time_scale=0.1, objective_ms=100.0)
    assert f["requests"] == 21 and f["ok"] == 20 and f["rejected"] == 1
    assert f["ttft_p95_ms"] == pytest.approx(190.5)  # wall ms x 0.1
    assert f["queue_p95_ms"] == pytest.approx(1.0)
    assert f["output_tok_s"] == pytest.approx(20.0)  # 200 tokens in 10 modelled seconds
    assert f["goodput_tok_s"] == pytest.approx(10.0)  # the 10 answers within 100 modelled ms


def test_jain_over_fair_shares_is_one_when_each_key_gets_its_share() -> None:
    # 8 quiet keys get all they asked for; the noisy key gets the rest: a fair split.
    rates = {f"quiet-{i}": 10.0 for i in range(8)} | {"noisy": 10.0}
    demand = {f"quiet-{i}": 10.0 for i in range(8)}
    assert fair_jain(rates, demand) == pytest.approx(1.0)
    # The quiet keys get half of what they got alone, the noisy key the rest.
    starved = {f"quiet-{i}": 5.0 for i in range(8)} | {"noisy": 50.0}
    assert fair_jain(starved, demand) == pytest.approx((8 * 0.5 + 50 / 10) ** 2 / (9 * (8 * 0.25 + 25)))
    # A noisy key with nothing: 8 of 9 at their share.
    assert fair_jain({**rates, "noisy": 0.0}, demand) == pytest.approx(64 / 72)


def test_verdicts_and_rejections_per_tier() -> None:
    solo = {"keys": {f"quiet-{i}": {"ttft_p95_ms": 100.0} for i in range(8)}}
    keys = {f"quiet-{i}": {"ttft_p95_ms": 140.0, "rejected": 0} for i in range(8)} | {"noisy": {"ttft_p95_ms": 900.0}}
    samples = [_s("noisy", 0, status=503), _s("premium", 0, tier="premium"), _s("noisy", 0)]
    rej = rejections_by_tier(samples)
    assert rej["standard"]["503"] == 1 and rej["premium"]["503"] == 0
    phase = {"keys": keys, "rejections": rej, "jain_throughput": 0.95, "jain_goodput": 0.85}
    v = verdict(phase, solo)
    assert v["worst_quiet_p95_vs_solo"] == 1.4 and v["quiet_ok"]
    assert v["jain_throughput_ok"] and not v["jain_goodput_ok"] and v["premium_ok"]
    keys["quiet-3"] = {"ttft_p95_ms": 160.0}
    rej["premium"]["429"] = 1
    v = verdict(phase, solo)
    assert not v["quiet_ok"] and v["worst_quiet_p95_vs_solo"] == 1.6 and not v["premium_ok"]
    keys["quiet-3"] = {"ttft_p95_ms": 140.0, "rejected": 2}  # a quiet key refused is not served fairly
    v = verdict(phase, solo)
    assert not v["quiet_ok"] and v["quiet_rejected"] == 2


def test_fleet_takes_a_scenario_and_keeps_affinity_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(fleet, "affinity_main", lambda argv: seen.append(("affinity", argv)) or 0)
    from loadtests.bench import fleet_fairness

    monkeypatch.setattr(fleet_fairness, "main", lambda argv: seen.append(("fairness", argv)) or 0)
    assert fleet.main(["--turns", "16"]) == 0
    assert fleet.main(["--scenario", "fairness", "--duration", "30"]) == 0
    assert fleet.main(["--scenario", "all", "--seed", "2"]) == 0
    assert seen == [("affinity", ["--turns", "16"]), ("fairness", ["--duration", "30"]),
                    ("affinity", ["--seed", "2"]), ("fairness", ["--seed", "2"])]
    with pytest.raises(SystemExit):
        fleet.main(["--scenario", "all", "--turns", "16"])
