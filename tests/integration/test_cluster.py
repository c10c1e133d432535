"""The production path on a real Ray cluster (README "Deploy"): ``ray start --head``, ``serve deploy
configs/cluster-cpu.yaml``, autoscaling under a locust load (1 -> 2 -> 1 replicas, no request
failed), admission capacity that follows the running replicas, and a config change deployed while
streams are in flight (none failed).

These tests start their own Ray cluster (tests/integration/cluster.py), so they run before the
session stack (the ``cluster`` marker; tests/conftest.py orders them). The tests of this module run
in order and share one cluster; each prints its figures (``pytest -s``).
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.integration.cluster import RayCluster, cluster_env, mounted_keys, write_config

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "cluster-cpu.yaml"
LOCUSTFILE = ROOT / "loadtests" / "locustfile.py"
CHAT = "model-tiny-chat"
KEYS = {"premium": "premium", "standard": "standard", "batch": "batch"}
LOAD_USERS = 8  # 8 streams in flight over 1 replica: twice target_ongoing_requests (4)


def load_limits(args: dict[str, Any]) -> None:
    """The test's only change to configs/cluster-cpu.yaml besides port, keys file and Redis: a
    standard key may send as many requests as the load needs (the load measures scaling, not RPM)."""
    args["tiers"]["standard"]["key_limits"]["rpm"] = 6000


@dataclass
class Deployed:
    cluster: RayCluster
    config: Path
    keys_file: Path
    keys: dict[str, str]
    redis_url: str
    figures: dict[str, Any] = field(default_factory=dict)

    def client(self, key: str = "premium") -> OpenAI:
        return OpenAI(base_url=self.cluster.base_url, api_key=self.keys[key], max_retries=0,
                      timeout=120)


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Deployed]:
    """README "Deploy": keys into the mounted file, ray start --head, serve deploy, serve status
    until RUNNING; at the end serve shutdown and ray stop (ray stop also after any failure)."""
    workdir = tmp_path_factory.mktemp("cluster")
    run_dir = Path(f"/tmp/sa-cl-{os.getpid()}")  # short: HAProxy's socket path is limited
    cluster = RayCluster(workdir=workdir, env=cluster_env(run_dir))
    keys_file, keys = mounted_keys(workdir, KEYS)
    config = write_config(CONFIG, workdir, cluster.http_port, keys_file, redis_url, load_limits)
    try:
        cluster.start_head()
        t0 = time.monotonic()
        cluster.deploy(config)
        cluster.wait_running(timeout_s=600)
        cluster.timings["deploy_to_running_s"] = time.monotonic() - t0
        print(f"\n[cluster] serve deploy -> RUNNING in {cluster.timings['deploy_to_running_s']:.0f} s")
        yield Deployed(cluster, config, keys_file, keys, redis_url)
        cluster.shutdown()
    finally:
        cluster.stop()


def test_deployed_app_answers_through_the_gateway_with_a_mounted_key(deployed: Deployed) -> None:
    c = deployed.client()
    r = c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=8)
    assert r.choices[0].message.content is not None and r.usage and r.usage.completion_tokens > 0
    e = c.embeddings.create(model="minilm-embed", input=["a cat"])
    assert len(e.data[0].embedding) == 384
    ids = {m.id for m in c.models.list().data}
    assert {"tiny-chat", "minilm-embed"} <= ids
    bad = httpx.post(f"{deployed.cluster.base_url}/chat/completions", json={"model": "tiny-chat"},
                     headers={"Authorization": "Bearer sk-wrong"}, timeout=30)
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    # One chat replica at first, and the gateway sizes its bounds for it.
    assert deployed.cluster.replicas(CHAT) == {"RUNNING": 1}
    tiny = _gateway_model(deployed.cluster, "tiny-chat", running=1)
    assert (tiny["capacity"], tiny["saturation"]) == (12 * 1 + 32, 20)


# ---- autoscaling under load ---------------------------------------------------------------------
def _gateway_model(cluster: RayCluster, model: str, running: int, timeout_s: float = 30) -> dict[str, Any]:
    """The gateway's view of a model once it counts ``running`` replicas (it polls every second)."""
    t0 = time.monotonic()
    while True:
        facts = cluster.diagnose()["models"][model]
        if facts["running_replicas"] == running or time.monotonic() - t0 > timeout_s:
            return facts  # type: ignore[no-any-return]
        time.sleep(1)


@dataclass
class Locust:
    proc: subprocess.Popen[bytes]
    csv_prefix: Path
    log: Path
    started: float

    def stop(self) -> tuple[int, int, str]:
        """SIGTERM (locust writes its final stats), then (requests, failures, failure lines)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        requests = failures = 0
        stats = Path(f"{self.csv_prefix}_stats.csv")
        assert stats.exists(), self.log.read_text()[-3000:]
        with stats.open() as f:
            for row in csv.DictReader(f):
                if row["Type"] == "POST":
                    requests += int(row["Request Count"])
                    failures += int(row["Failure Count"])
        failed = Path(f"{self.csv_prefix}_failures.csv")
        return requests, failures, failed.read_text() if failed.exists() else ""


def _locust(d: Deployed, tmp: Path, name: str, users: int, mix: str) -> Locust:
    env = dict(os.environ)
    for tier in ("premium", "standard"):
        env[f"SERVE_APP_KEY_{tier.upper()}"] = d.keys[tier]
    log = tmp / f"{name}.log"
    argv = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
            "--host", d.cluster.base_url.removesuffix("/v1"), "-u", str(users), "-r", str(users),
            "-t", "600s", "--app-config", str(d.config), "--model", "tiny-chat", "--mix", mix,
            "--max-output-tokens", "64", "--csv", str(tmp / name), "--only-summary"]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    return Locust(proc, tmp / name, log, time.monotonic())


def _wait_replicas(d: Deployed, want: dict[str, int], load: Locust, timeout_s: float) -> float:
    t0 = time.monotonic()
    while True:
        states = d.cluster.replicas(CHAT)
        if states == want:
            return time.monotonic() - load.started
        assert load.proc.poll() is None, load.log.read_text()[-3000:]
        assert time.monotonic() - t0 < timeout_s, f"replicas {states}, want {want}"
        time.sleep(1)


def test_locust_load_scales_the_model_up_and_back_down_without_failures(
        deployed: Deployed, tmp_path: Path) -> None:
    d = deployed
    load = _locust(d, tmp_path, "load", LOAD_USERS, "premium=1,standard=1")
    try:
        up_s = _wait_replicas(d, {"RUNNING": 2}, load, timeout_s=300)
        # The gateway sees the second replica within a refresh: its bounds grow.
        grown = _gateway_model(d.cluster, "tiny-chat", running=2)
        time.sleep(5)  # the load goes on across both replicas for a moment
    finally:
        requests, failures, failed = load.stop()
    print(f"\n[cluster] scale up 1 -> 2: {up_s:.0f} s after the load started; "
          f"{requests} requests, {failures} failed; gateway bounds at 2 replicas: "
          f"capacity {grown['capacity']}, saturation {grown['saturation']}")
    assert failures == 0, failed
    assert requests > 0
    assert (grown["running_replicas"], grown["capacity"], grown["saturation"]) == (2, 12 * 2 + 32, 40)

    # A trickle of requests while the autoscaler takes the second replica away: the stopping
    # replica drains its streams (graceful_shutdown_timeout_s), nothing fails.
    trickle = _locust(d, tmp_path, "trickle", 1, "premium=1")
    trickle.started = time.monotonic()
    try:
        down_s = _wait_replicas(d, {"RUNNING": 1}, trickle, timeout_s=300)
        shrunk = _gateway_model(d.cluster, "tiny-chat", running=1)
    finally:
        requests, failures, failed = trickle.stop()
    print(f"[cluster] scale down 2 -> 1: {down_s:.0f} s after the load stopped; "
          f"{requests} requests, {failures} failed; gateway bounds at 1 replica: "
          f"capacity {shrunk['capacity']}, saturation {shrunk['saturation']}")
    assert failures == 0, failed
    assert requests > 0
    assert (shrunk["running_replicas"], shrunk["capacity"], shrunk["saturation"]) == (1, 44, 20)


# ---- a config change while streams are in flight -------------------------------------------------
@dataclass
class StreamLoad:
    """Threads that each stream chat completions back to back and record every outcome."""

    url: str
    key: str
    threads: int
    stop: threading.Event = field(default_factory=threading.Event)
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    inflight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    workers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for _ in range(self.threads):
            t = threading.Thread(target=self._loop, daemon=True)
            t.start()
            self.workers.append(t)

    def _loop(self) -> None:
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "tell a story"}],
                "max_tokens": 256, "ignore_eos": True, "stream": True}
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(timeout=180) as http:
            while not self.stop.is_set():
                with self.lock:
                    self.inflight += 1
                try:
                    with http.stream("POST", f"{self.url}/chat/completions", json=body,
                                     headers=headers) as r:
                        text = "".join(r.iter_text())
                    good = r.status_code == 200 and "data: [DONE]" in text and '"error"' not in text
                    outcome = None if good else f"{r.status_code}: {text[-300:]}"
                except Exception as exc:
                    outcome = f"{exc.__class__.__name__}: {exc}"
                with self.lock:
                    self.inflight -= 1
                    if outcome is None:
                        self.ok += 1
                    else:
                        self.failed.append(outcome)

    def finish(self) -> None:
        self.stop.set()
        for t in self.workers:
            t.join(timeout=240)


def changed_config(args: dict[str, Any]) -> None:
    load_limits(args)
    args["tiers"]["batch"]["key_limits"]["max_tokens_cap"] = 8  # was 1024
    tiny = next(m for m in args["models"] if m["id"] == "tiny-chat")
    tiny["engine"]["max_num_seqs"] = 6  # was 8: the engine restarts, in a new replica


def _engine_seqs(c: RayCluster) -> int | None:
    """max_num_seqs of the chat replica that answers ``serve-app diagnose``."""
    import json

    done = c.diagnose_raw()
    for line in done.stdout.splitlines():
        if line.startswith(f"{CHAT}: "):
            return json.loads(line.split(": ", 1)[1]).get("max_num_seqs")  # type: ignore[no-any-return]
    return None


def test_config_change_while_streams_are_in_flight_fails_none(deployed: Deployed) -> None:
    d = deployed
    c = d.cluster
    batch = d.client("batch")
    before = batch.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=20,
        extra_body={"ignore_eos": True})
    assert before.usage is not None and before.usage.completion_tokens == 20

    load = StreamLoad(c.base_url, d.keys["premium"], threads=6)
    load.start()
    try:
        t_wait = time.monotonic()
        while load.inflight < 4:
            assert time.monotonic() - t_wait < 30, "the streams did not start"
            time.sleep(0.1)
        inflight_at_deploy = load.inflight
        new = write_config(CONFIG, c.workdir, c.http_port, d.keys_file, d.redis_url, changed_config,
                           name="serve-v2.yaml")
        t0 = time.monotonic()
        c.deploy(new)
        # The controller replaces the gateway and chat replicas, each new one before its old one
        # stops (max_surge_percent: 100). Done: every deployment HEALTHY with only RUNNING
        # replicas, and the chat replica is the new one (max_num_seqs 6).
        c.wait_running(timeout_s=400, what="the updated app", ready=lambda app: all(
            dep.get("status") == "HEALTHY" and set(dep.get("replica_states") or {}) == {"RUNNING"}
            for dep in (app.get("deployments") or {}).values()) and _engine_seqs(c) == 6)
        update_s = time.monotonic() - t0
        time.sleep(3)  # streams begun just before the last old replica stopped end on new ones
    finally:
        load.finish()
    print(f"\n[cluster] config change: {inflight_at_deploy} streams in flight at serve deploy, "
          f"update done in {update_s:.0f} s; {load.ok} streams completed, {len(load.failed)} failed")
    assert load.failed == [], load.failed[:5]
    assert load.ok >= inflight_at_deploy

    # New requests see the new settings: batch's cap, and the chat engine's max_num_seqs.
    after = batch.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=20,
        extra_body={"ignore_eos": True})
    assert after.usage is not None and after.usage.completion_tokens == 8
    assert _engine_seqs(c) == 6

    # Key changes still apply within seconds on the new gateway replicas.
    from tests.keys import create_key

    t_key = time.monotonic()
    secret = create_key(d.keys_file, "after-update", "premium", ["*"])
    streak = 0
    while streak < 4:  # twice the gateway replicas in a row: each one has read the file
        r = httpx.get(f"{c.base_url}/models", headers={"Authorization": f"Bearer {secret}"}, timeout=10)
        streak = streak + 1 if r.status_code == 200 else 0
        assert time.monotonic() - t_key < 15, r.text
        time.sleep(0.1)
    print(f"[cluster] a key created after the update works in {time.monotonic() - t_key:.1f} s")


# ---- tensor parallelism on CPU ---------------------------------------------------------------------
TP2 = "tiny-chat-tp2"
PROMPTS = ["hello there", "the quick brown fox", "tell me about ray serve"]


def with_tp2(args: dict[str, Any]) -> None:
    """The updated config plus the same chat model with tensor_parallel_size 2: vLLM's mp executor
    (the only one vLLM allows on CPU), one rank per core by explicit thread binding."""
    changed_config(args)
    tiny = next(m for m in args["models"] if m["id"] == "tiny-chat")
    args["models"].append({
        "id": TP2, "source": tiny["source"],
        "engine": {**tiny["engine"], "tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
        "deployment": {"num_replicas": 1, "max_ongoing_requests": 12, "max_queued_requests": 32},
        "accelerator": {"kind": "cpu", "cpus_per_worker": 1},
        "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    })


def _greedy(c: OpenAI, model: str) -> list[str]:
    out = []
    for p in PROMPTS:
        r = c.completions.create(model=model, prompt=p, max_tokens=24, temperature=0)
        out.append(r.choices[0].text)
    return out


def test_tensor_parallel_2_on_cpu_places_one_bundle_and_matches_tp1(deployed: Deployed) -> None:
    d = deployed
    c = d.cluster
    cfg = write_config(CONFIG, c.workdir, c.http_port, d.keys_file, d.redis_url, with_tp2,
                       name="serve-tp2.yaml")
    t0 = time.monotonic()
    c.deploy(cfg)
    c.wait_running(timeout_s=400, what="the app with a TP=2 model", ready=lambda app: "model-" + TP2 in (
        app.get("deployments") or {}) and all(dep.get("status") == "HEALTHY"
                                              for dep in app["deployments"].values()))
    print(f"\n[cluster] TP=2 model deployed in {time.monotonic() - t0:.0f} s")
    # Ray's state API: the replica's placement group holds one bundle with the CPUs of both ranks
    # (on CPU the mp executor forks its workers inside the replica; on GPU: one bundle per rank).
    done = c.run([str(Path(sys.executable).parent / "ray"), "list", "placement-groups", "--detail",
                  "--format", "json", "--address", c.dashboard], timeout_s=60)
    import json

    def resources(g: dict[str, Any]) -> list[dict[str, float]]:
        return [b.get("unit_resources") or b.get("unitResources") or {} for b in g.get("bundles") or []]

    # Ray Serve names a replica's placement group after the replica: SERVE_REPLICA::llm#<deployment>#id
    groups = [g for g in json.loads(done.stdout) if g.get("state") == "CREATED"]
    mine = [g for g in groups if f"#model-{TP2}#" in (g.get("name") or "")]
    print(f"[cluster] TP=2 placement group: {[(g.get('name'), resources(g)) for g in mine]}")
    assert len(mine) == 1, groups
    assert resources(mine[0]) == [{"CPU": 2.0}]
    client = d.client()
    tp1, tp2 = _greedy(client, "tiny-chat"), _greedy(client, TP2)
    print(f"[cluster] greedy TP=1 {tp1!r}\n[cluster] greedy TP=2 {tp2!r}")
    assert tp1 == tp2 and all(tp1)
