"""The fleet benchmark's pure parts (loadtests/bench/fleet.py): the engines' TTFT quantile from
histogram buckets, and its sessions (the hot tenant's half, the prompt sizes)."""

from __future__ import annotations

import argparse
import math

from loadtests.bench.fleet import CHARS_PER_TOKEN, quantile, sessions_for


def test_quantile_interpolates_within_the_bucket_between_two_scrapes() -> None:
    before = {0.1: 5.0, 0.5: 5.0, 1.0: 5.0, math.inf: 5.0}
    after = {0.1: 15.0, 0.5: 25.0, 1.0: 45.0, math.inf: 45.0}  # 10 / 10 / 20 new observations
    assert quantile(before, after, 0.25) == 0.1
    assert abs(quantile(before, after, 0.5) - 0.5) < 1e-9
    assert abs(quantile(before, after, 0.75) - 0.75) < 1e-9
    assert math.isnan(quantile(after, after, 0.5))


def test_sessions_give_the_hot_tenant_half_and_prompts_their_size() -> None:
    ns = argparse.Namespace(sessions=64, tenants=16, tenant_tokens=2000, prompt_tokens=30000)
    sessions = sessions_for(ns, [f"k{i}" for i in range(16)], seed=3)
    assert len(sessions) == 64
    assert sum(s.tenant == 0 for s in sessions) == 32
    assert {s.tenant for s in sessions} == set(range(16))
    for s in sessions:
        assert abs(len(s.system) / CHARS_PER_TOKEN - 30000) < 100
        assert s.key == f"k{s.tenant}"
    # Sessions of one tenant share its system prompt, and only that.
    a, b = [s for s in sessions if s.tenant == 0][:2]
    assert a.system[:2000 * CHARS_PER_TOKEN] == b.system[:2000 * CHARS_PER_TOKEN]
    assert a.system != b.system
