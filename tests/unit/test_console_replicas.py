"""The console's replicas page (``console_replicas``): the gateway's own view of the running
replicas joined with the engines' ``ray_vllm_*`` figures from Prometheus. A tiny local server
answers in the query API's shape, and a real ``prometheus`` scrapes a tiny exporter of those
series under the names Ray's metrics agent gives them, so every query runs in Prometheus."""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from serve_app.gateway.http.console_replicas import QUERIES, engine_figures, replica_rows
from serve_app.local.prometheus import Prometheus, write_sd_file
from tests.keys import run
from tests.unit.console_client import Console
from tests.unit.test_admin_api import Admin
from tests.unit.test_console_sla import Fake, _vector

R1 = "tiny-chat#abc123"


class Replicas:
    """``LiveReplicas`` as the page reads it: endpoints per model."""

    def __init__(self, endpoints: Mapping[str, Mapping[str, tuple[str, int]]]) -> None:
        self._endpoints = endpoints

    def endpoints(self, model_id: str) -> Mapping[str, tuple[str, int]]:
        return self._endpoints.get(model_id, {})


def _answers(path: str, q: Mapping[str, list[str]]) -> tuple[int, dict[str, Any]]:
    query = q["query"][0]
    where = {"model_name": "tiny-chat", "ReplicaId": R1}
    if query == QUERIES["adapters"]:  # two series: the newer one (larger value) holds now
        return 200, _vector(({**where, "running_lora_adapters": "old"}, "100"),
                            ({**where, "running_lora_adapters": "tiny-pirate,b"}, "200"))
    value = {"running": "3", "waiting": "1", "kv_cache": "0.25", "hit_rate": "NaN"}
    name = next(k for k, v in QUERIES.items() if v == query)
    return 200, _vector((where, value[name]))


def test_the_figures_are_read_per_replica_with_the_newest_adapters() -> None:
    with Fake(_answers) as prom:
        got = run(engine_figures(prom.url))
    assert got == {("tiny-chat", R1): {"running": 3.0, "waiting": 1.0, "kv_cache": 0.25,
                                       "adapters": ["b", "tiny-pirate"]}}  # hit rate NaN: left out
    assert sorted(q["query"][0] for _, q in prom.seen) == sorted(QUERIES.values())


def test_the_page_joins_the_gateways_replicas_with_prometheus(tmp_path: Path) -> None:
    with Fake(_answers) as prom:
        a = Admin(tmp_path, gateway={"console": {"prometheus_url": prom.url}})
        a.deps.replicas = Replicas({"tiny-chat": {R1: ("10.0.0.5", 41000)}})  # type: ignore[assignment]
        with a.client:
            c = Console(a)
            c.signin(a.admin)
            page = c.get("/console/replicas")
    assert page.status_code == 200
    assert f"<td>{R1}</td><td>10.0.0.5:41000</td><td>3</td><td>1</td><td>25.0%</td><td>n/a</td>" in page.text
    assert "<td>b, tiny-pirate</td>" in page.text
    assert 'href="/console/replicas" aria-current="page"' in page.text


def test_without_prometheus_the_page_still_lists_the_replicas(tmp_path: Path) -> None:
    a = Admin(tmp_path)
    rows, note = run(replica_rows(a.deps, Replicas({"tiny-chat": {R1: ("127.0.0.1", 5)}})))
    assert "gateway.console.prometheus_url" in note
    assert rows == [{"model": "tiny-chat", "replica": R1, "endpoint": "127.0.0.1:5", "adapters_configured": []}]
    rows, _ = run(replica_rows(a.deps, None))
    assert rows == [{"model": "tiny-chat", "replica": None, "endpoint": None, "adapters_configured": []}]


def test_the_page_needs_a_session(tmp_path: Path) -> None:
    a = Admin(tmp_path)
    with a.client:
        r = a.client.get("/console/replicas", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/console/signin")


def _exposition(start: float) -> str:
    """The engine's series as Ray's metrics agent serves them: two scrapes apart, the prefix
    cache's counters have grown (3 hits per 4 queries)."""
    n = int((time.monotonic() - start) * 4) + 1
    labels = f'model_name="tiny-chat",ReplicaId="{R1}"'
    return "\n".join([
        "# TYPE ray_vllm_num_requests_running gauge", f"ray_vllm_num_requests_running{{{labels}}} 2",
        "# TYPE ray_vllm_num_requests_waiting gauge", f"ray_vllm_num_requests_waiting{{{labels}}} 0",
        "# TYPE ray_vllm_kv_cache_usage_perc gauge", f"ray_vllm_kv_cache_usage_perc{{{labels}}} 0.5",
        "# TYPE ray_vllm_prefix_cache_queries_total counter",
        f"ray_vllm_prefix_cache_queries_total{{{labels}}} {400 * n}",
        "# TYPE ray_vllm_prefix_cache_hits_total counter",
        f"ray_vllm_prefix_cache_hits_total{{{labels}}} {300 * n}",
        "# TYPE ray_vllm_lora_requests_info gauge",
        f'ray_vllm_lora_requests_info{{{labels},running_lora_adapters="tiny-pirate",'
        f'waiting_lora_adapters="",max_lora="1"}} 1.7e9',
    ]) + "\n"


def test_the_queries_run_in_a_real_prometheus(tmp_path: Path) -> None:
    if shutil.which("prometheus") is None:  # a failure under CI (tests/conftest.py)
        pytest.skip("prometheus is not installed (run scripts/system-deps.sh)")
    start = time.monotonic()
    with Fake(lambda path, q: (200, _exposition(start))) as exporter:
        sd = write_sd_file(tmp_path / "sd.json", [exporter.url.removeprefix("http://")])
        prom = Prometheus(tmp_path / "prom", sd, scrape_interval_s=1)
        prom.start()
        try:
            deadline = time.monotonic() + 30
            got: dict[str, Any] = {}
            while "hit_rate" not in got:  # two scrapes make a rate
                assert time.monotonic() < deadline, f"no hit rate after 30 s: {got}"
                time.sleep(1)
                got = run(engine_figures(prom.url)).get(("tiny-chat", R1), {})
        finally:
            prom.stop()
    assert got == {"running": 2.0, "waiting": 0.0, "kv_cache": 0.5, "hit_rate": pytest.approx(0.75),
                   "adapters": ["tiny-pirate"]}
