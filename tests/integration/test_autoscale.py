"""Autoscaling on the top tier's objective (serve_app/engine/autoscale.py) on a real Ray cluster.

A load step on one replica brings premium's TTFT p95 toward its objective; the policy must ask for a
second replica within 20 s of the p95 reaching half of the objective (its wait trigger), premium must meet its
objective for at least 90 % of the step's requests, and after the load ends the model goes back to
one replica and stays there (one scale-up, one scale-down, nothing else) while a trickle goes on.

The model is a synthetic upstream (serve_app/engine/synthetic.py: no engine, a stream of
``TOKENS`` at ``TOKENS_PER_S``) whose replicas take ``SLOTS`` requests at once
(``max_ongoing_requests``): more wait in Ray Serve's queue, so a replica's TTFT grows with its load
and a second replica takes it back, as an engine's would, but without two vLLM engines fighting
over the machine's two cores. ``target_ongoing_requests`` is far above the load, so only the
objective can ask for the second replica. The delays are seconds, not production's minutes
(``QUIET_S`` stands for the issue's 5 minutes); the test prints every figure (``pytest -s``).
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from serve_app.engine.autoscale import p95
from tests.integration.cluster import RayCluster, cluster_env, mounted_keys, write_config

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "cluster-cpu.yaml"
MODEL = "synthetic-chat"
DEPLOYMENT = "model-synthetic-chat"
KEYS = {"premium": "premium", "standard": "standard", "batch": "batch"}
OBJECTIVE_S = 1.2  # premium's TTFT objective in this test
SLOTS = 4  # requests a replica runs at once; the rest wait in Ray Serve's queue
TOKENS, TOKENS_PER_S, SYNTH_TTFT_MS = 40, 50.0, 50.0  # a stream lasts about 0.85 s
USERS = 8  # closed loop: twice a replica's slots, so each request waits about one stream
WINDOW_S = 5.0  # the replicas' p95 window (objective_policy.window_s)
MIN_SAMPLES = 5
UPSCALE_DELAY_S, DOWNSCALE_DELAY_S = 2.0, 10.0
STEP_S = 60.0  # the load step
QUIET_S = 90.0  # after the step: a trickle, the scale-down, then no change
ASK_WITHIN_S = 20.0


def autoscale_config(args: dict[str, Any]) -> None:
    """configs/cluster-cpu.yaml's tiers, with premium's objective at OBJECTIVE_S and room for the
    load in its key limits; one gateway replica and one synthetic model on the objective policy."""
    premium = args["tiers"]["premium"]
    premium["objectives"]["ttft_p95_ms"] = OBJECTIVE_S * 1000
    premium["key_limits"]["rpm"] = 6000
    args["gateway"]["num_replicas"] = 1
    args["routes"] = []
    args["models"] = [{
        "id": MODEL, "source": "synthetic",
        "synthetic": {"tokens_per_s": TOKENS_PER_S, "ttft_ms": SYNTH_TTFT_MS},
        "deployment": {
            "autoscaling_config": {
                "min_replicas": 1, "initial_replicas": 1, "max_replicas": 2,
                "target_ongoing_requests": 32,  # 4x the load: never the reason to scale
                "upscale_delay_s": UPSCALE_DELAY_S, "downscale_delay_s": DOWNSCALE_DELAY_S,
                "metrics_interval_s": 1, "look_back_period_s": WINDOW_S,
                "objective_policy": {"window_s": WINDOW_S, "min_samples": MIN_SAMPLES},
            },
            "max_ongoing_requests": SLOTS,
            "graceful_shutdown_timeout_s": 10,
        },
        "accelerator": {"kind": "cpu", "cpus_per_worker": 0.5},
    }]


@dataclass
class Sample:
    sent: float  # monotonic
    ttft_s: float | None
    error: str | None


@dataclass
class Streams:
    """``users`` threads that each stream a chat completion after another (a closed loop)."""

    url: str
    key: str
    users: int
    stop: threading.Event = field(default_factory=threading.Event)
    samples: list[Sample] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    workers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Streams:
        for _ in range(self.users):
            t = threading.Thread(target=self._loop, daemon=True)
            t.start()
            self.workers.append(t)
        return self

    def _loop(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": TOKENS, "stream": True}
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                t0 = time.monotonic()
                ttft = error = None
                try:
                    with http.stream("POST", f"{self.url}/chat/completions", json=body,
                                     headers=headers) as r:
                        for line in r.iter_lines():
                            if ttft is None and line.startswith("data: "):
                                ttft = time.monotonic() - t0
                        if r.status_code != 200:
                            error = f"HTTP {r.status_code}"
                except httpx.HTTPError as exc:
                    error = f"{exc.__class__.__name__}: {exc}"
                with self.lock:
                    self.samples.append(Sample(t0, ttft, error))

    def finish(self) -> list[Sample]:
        self.stop.set()
        for t in self.workers:
            t.join(timeout=60)
        with self.lock:
            return list(self.samples)


@dataclass
class Watch:
    """Polls ``serve status`` and records each change of the model's replica states, with the
    replicas that are not stopping (``active``)."""

    cluster: RayCluster
    stop: threading.Event = field(default_factory=threading.Event)
    changes: list[tuple[float, int, dict[str, int]]] = field(default_factory=list)
    thread: threading.Thread | None = None

    def start(self) -> Watch:
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self

    def _loop(self) -> None:
        last = None
        while not self.stop.is_set():
            states = self.cluster.replicas(DEPLOYMENT)
            t = time.monotonic()
            active = sum(n for s, n in states.items() if s != "STOPPING")
            if states != last:
                self.changes.append((t, active, states))
                last = states
            time.sleep(0.2)

    def finish(self) -> list[tuple[float, int, dict[str, int]]]:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=60)
        return self.changes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[tuple[RayCluster, dict[str, str]]]:
    workdir = tmp_path_factory.mktemp("autoscale")
    run_dir = Path(f"/tmp/sa-as-{os.getpid()}")  # short: HAProxy's socket path is limited
    c = RayCluster(workdir=workdir, env=cluster_env(run_dir))
    keys_file, keys = mounted_keys(workdir, KEYS)
    config = write_config(CONFIG, workdir, c.http_port, keys_file, redis_url, autoscale_config)
    try:
        c.start_head()
        c.deploy(config)
        c.wait_running(timeout_s=300)
        yield c, keys
        c.shutdown()
    finally:
        c.stop()


def first_crossing(samples: list[Sample], t0: float, level_s: float) -> float | None:
    """When the premium TTFT p95 over the last WINDOW_S (by first token) first reached
    ``level_s``, in seconds after ``t0``; None if it never did."""
    firsts = sorted((s.sent + s.ttft_s, s.ttft_s) for s in samples if s.ttft_s is not None)
    for i, (t, _) in enumerate(firsts):
        window = [v for u, v in firsts[: i + 1] if u > t - WINDOW_S]
        if len(window) >= MIN_SAMPLES and p95(window) >= level_s:
            return t - t0
    return None


def policy_log() -> list[str]:
    """The policy's decisions, from the Serve controller's log of this cluster's session."""
    logs = Path("/tmp/ray/session_latest/logs/serve")
    return [line.strip() for p in sorted(logs.glob("controller_*.log"))
            for line in p.read_text(errors="replace").splitlines()
            if re.search(r"autoscale model-", line)]


def test_objective_policy_scales_up_on_premium_ttft_and_back_down_without_flapping(
        cluster: tuple[RayCluster, dict[str, str]]) -> None:
    c, keys = cluster
    assert c.replicas(DEPLOYMENT) == {"RUNNING": 1}
    watch = Watch(c).start()
    t0 = time.monotonic()
    load = Streams(c.base_url, keys["premium"], USERS).start()
    time.sleep(STEP_S)
    step = load.finish()
    t_end = time.monotonic()
    trickle = Streams(c.base_url, keys["premium"], 1).start()
    time.sleep(QUIET_S)
    quiet = trickle.finish()
    changes = watch.finish()

    ttfts = [s.ttft_s for s in step if s.ttft_s is not None]
    met = sum(1 for v in ttfts if v <= OBJECTIVE_S)
    attainment = met / len(ttfts) if ttfts else 0.0
    # Half the objective: the policy's wait trigger (wait_up_at 0.5), which fires first when a
    # replica's queue builds. Its TTFT trigger is at 80 %, which this step reaches only sometimes
    # since the queue moved into the replica (issue 37; one run's first phase: p95 0.947 s against
    # 0.96), because the policy has asked for the second replica on the wait by then.
    crossed = first_crossing(step, t0, 0.5 * OBJECTIVE_S)
    asked = next((t - t0 for t, active, _ in changes if active >= 2), None)
    counts = [active for i, (_, active, _) in enumerate(changes)
              if i == 0 or active != changes[i - 1][1]]
    ups = sum(1 for a, b in zip(counts, counts[1:], strict=False) if b > a)
    downs = sum(1 for a, b in zip(counts, counts[1:], strict=False) if b < a)
    errors = [s.error for s in step + quiet if s.error]
    after_down = next((t - t_end for t, active, _ in changes if t > t_end and active == 1), None)
    print(f"\n[autoscale] objective {OBJECTIVE_S:.2f} s; step {USERS} users x {STEP_S:.0f} s: "
          f"{len(step)} requests, TTFT p50 {sorted(ttfts)[len(ttfts) // 2] if ttfts else 0:.3f} s, "
          f"p95 {p95(ttfts):.3f} s, attainment {attainment:.1%}")
    print(f"[autoscale] premium p95 reached 50 % of the objective at "
          f"{'never' if crossed is None else f'{crossed:.1f} s'}; second replica asked at "
          f"{'never' if asked is None else f'{asked:.1f} s'} (after the step's start)")
    print(f"[autoscale] after the step: back to 1 replica at "
          f"{'never' if after_down is None else f'{after_down:.1f} s'}; watched {QUIET_S:.0f} s "
          f"with a trickle ({len(quiet)} requests, TTFT p95 "
          f"{p95([s.ttft_s for s in quiet if s.ttft_s is not None]):.3f} s)")
    print("[autoscale] replica changes: " + ", ".join(
        f"{t - t0:.1f} s -> {active} {states}" for t, active, states in changes))
    for line in policy_log():
        print(f"[autoscale] policy: {line}")
    _per_phase(step, t0, changes)

    assert not errors, errors[:5]
    assert crossed is not None, "the load step never brought premium's p95 to 50 % of its objective"
    assert asked is not None and asked - crossed <= ASK_WITHIN_S, (crossed, asked)
    assert attainment >= 0.9
    assert (ups, downs) == (1, 1), changes
    assert counts[-1] == 1


def _per_phase(step: list[Sample], t0: float, changes: list[tuple[float, int, dict[str, int]]]) -> None:
    """Premium TTFT while one replica served the step and once two did (for the report)."""
    two = next((t for t, _, states in changes if states.get("RUNNING", 0) >= 2), math.inf)
    for name, part in (("1 replica", [s for s in step if s.sent < two]),
                       ("2 replicas", [s for s in step if s.sent >= two])):
        v = [s.ttft_s for s in part if s.ttft_s is not None]
        if v:
            print(f"[autoscale] {name}: {len(v)} requests, TTFT p95 {p95(v):.3f} s, "
                  f"attainment {sum(1 for x in v if x <= OBJECTIVE_S) / len(v):.1%}")
