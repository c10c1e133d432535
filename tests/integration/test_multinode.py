"""Two Ray nodes on this machine (a head and a worker, each started with ``ray start`` and its own
custom resource): the gateway on the head, the chat model on the worker. Requests work end to end;
killing the worker's raylet makes the model unavailable (503 with Retry-After, not a hang), and
starting the worker again brings it back.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtests.harness.stack import Proc, cmdline, descendants, free_port, spawn, stop
from tests.integration.cluster import HOST, RayCluster, cluster_env, mounted_keys, write_config

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "cluster-cpu.yaml"
BIN = Path(sys.executable).parent


def two_nodes(args: dict[str, Any]) -> None:
    """The gateway on the head node, the chat model on the worker node (custom resources); one
    gateway replica and only the chat model, to keep the test short."""
    args["gateway"].update(num_replicas=1, resources={"head_node": 0.01})
    args["gateway"].setdefault("http", {})["unavailable_hold_s"] = 5
    tiny = next(m for m in args["models"] if m["id"] == "tiny-chat")
    tiny["deployment"] = {"num_replicas": 1, "max_ongoing_requests": 12, "max_queued_requests": 32,
                          "health_check_period_s": 2, "health_check_timeout_s": 5}
    tiny["accelerator"]["resources"] = {"model_node": 0.01}
    args["models"] = [tiny]


def start_worker(cluster: RayCluster, log: Path) -> Proc:
    """``ray start --address <head> --block`` with the ``model_node`` resource and ports of its
    own (a second node on the same host), as a process tree that this test can stop."""
    argv = [str(BIN / "ray"), "start", "--address", f"{HOST}:{cluster.gcs_port}", "--block",
            "--node-ip-address", HOST, "--num-cpus", "4", "--resources", json.dumps({"model_node": 1}),
            "--dashboard-agent-listen-port", str(free_port()),
            "--dashboard-agent-grpc-port", str(free_port()), "--metrics-export-port", str(free_port()),
            "--runtime-env-agent-port", str(free_port()), "--disable-usage-stats"]
    return spawn("ray worker node", argv, log, env=cluster.env)


def raylet_of(proc: Proc) -> int:
    for pid in descendants(proc.pid):
        if cmdline(pid)[:1] and cmdline(pid)[0].endswith("/raylet"):
            return pid
    raise AssertionError("no raylet under the worker node's ray start")


def wait_chat(url: str, key: str, want: int, timeout_s: float) -> tuple[float, httpx.Response]:
    t0 = time.monotonic()
    while True:
        try:
            r = httpx.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 4}, timeout=60)
            if r.status_code == want:
                return time.monotonic() - t0, r
        except httpx.TimeoutException:
            pass
        assert time.monotonic() - t0 < timeout_s, f"no {want} within {timeout_s} s"
        time.sleep(1)


@pytest.fixture(scope="module")
def two_node(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[tuple[RayCluster, Any]]:
    workdir = tmp_path_factory.mktemp("multinode")
    cluster = RayCluster(workdir=workdir, env=cluster_env(Path(f"/tmp/sa-mn-{os.getpid()}")))
    keys_file, keys = mounted_keys(workdir, {"premium": "premium"})
    config = write_config(CONFIG, workdir, cluster.http_port, keys_file, redis_url, two_nodes)
    workers: list[Proc] = []
    try:
        cluster.start_head(num_cpus=4, resources={"head_node": 1})
        workers.append(start_worker(cluster, workdir / "worker.log"))
        cluster.deploy(config)
        cluster.wait_running(timeout_s=600)
        yield cluster, (keys, workers, workdir)
        cluster.shutdown()
    finally:
        for w in workers:
            stop(w, first=signal.SIGTERM, timeout_s=30)
        cluster.stop()


def test_losing_the_model_node_answers_503_and_recovers(two_node: tuple[RayCluster, Any]) -> None:
    cluster, (keys, workers, workdir) = two_node
    key = keys["premium"]
    _, ok = wait_chat(cluster.base_url, key, 200, 60)
    assert ok.headers["x-served-by"] == "tiny-chat"
    os.kill(raylet_of(workers[0]), signal.SIGKILL)
    t_kill = time.monotonic()
    # Every request until the model is back gets an answer within the client's patience: 503 with
    # Retry-After once the gateway counts no running replica, never a hang.
    waited, r = wait_chat(cluster.base_url, key, 503, 120)
    assert r.headers.get("retry-after") and r.json()["error"]["type"]
    hang = time.monotonic() - t_kill
    stop(workers[0], first=signal.SIGTERM, timeout_s=30)
    t_restart = time.monotonic()
    workers.append(start_worker(cluster, workdir / "worker-2.log"))
    back, _ = wait_chat(cluster.base_url, key, 200, 300)
    print(f"\n[multinode] after the raylet kill: first 503 in {hang:.0f} s; after the restart the "
          f"model answers again in {time.monotonic() - t_restart:.0f} s")
    assert hang < 30
