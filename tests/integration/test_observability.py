"""Engine and gateway metrics in a real Prometheus: after the README's mixed-tier locust load (45 s,
half its users: the session stack's engine has 4 slots) against the session stack, with a light independent client per tier beside it, every dashboard
panel's query returns data, every alert expression evaluates, per tier Prometheus's TTFT p95 agrees
with the client's and its verdict with locust's, and the SLA panels render to a PNG.

Prometheus (Debian's package) listens on 127.0.0.1 and scrapes Ray's metrics export, which Ray binds
to the node's own IP: that address is this machine's, so the scrape stays on this host.
Artifacts (PNG report, Prometheus screenshot, series counts) go to results/observability/.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from dashboards import alerts
from dashboards.promql import PromQL
from dashboards.queries import TPOT, TTFT, boards, concrete, sla_board
from loadtests.bench.sla import ClientLog, agrees_with_sample, chat_once, every, percentile, quantile_interval
from loadtests.prompts import load_prompts
from serve_app.config import load_app_config
from serve_app.local.prometheus import Prometheus, targets_from_nodes, write_sd_file
from serve_app.metrics import ENGINE_METRICS, METRICS, SERVE_METRICS, exported
from tests.keys import create_key

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DASH = ROOT / "dashboards"
ARTIFACTS = ROOT / "results" / "observability"
TIERS = ("premium", "standard", "batch")
# The README's locust example is -u 12 for configs/local.yaml's 64 engine slots; the session stack
# has 4 (one premium's alone), where -u 12 starves batch behind the other tiers by design (strict
# priority): half the users, 45 s instead of 2 minutes.
USERS, LOAD_S = 6, 45
CLIENT_EVERY_S = 1.0
CLIENT_TIMEOUT_S = 120.0  # a slow answer stays in the client's sample (a timeout would drop it)
EXPORT_DELAY_S = 20  # Ray's agent exports every ~10 s; Prometheus scrapes every 2 s
# Counters that vLLM only creates when the event happens (none may happen in a short run); their
# panels fall back to zeros, so they still show data.
# Gateway metrics that exist only where their feature runs: an SLO miss; a model routed by affinity
# (more than one replica; the session stack has one); a model with a flow queue (off in local.yaml).
ONLY_WHEN_USED = {"slo_misses_total", "routing_decisions_total", "queue_depth", "queue_wait_seconds",
                  "flow_inflight_bound"}
EVENT_ONLY = {"ray_vllm_num_preemptions_total", "ray_vllm_prefix_cache_hits_total"}


@pytest.fixture(scope="module")
def prom(stack, serve_handles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed (run scripts/system-deps.sh)")
    import ray

    work = tmp_path_factory.mktemp("prometheus")
    sd = write_sd_file(work / "ray_sd.json", targets_from_nodes(ray.nodes()))
    p = Prometheus(work, sd, rule_files=[DASH / "alerts.yaml"], scrape_interval_s=2)
    p.start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def load(stack, prom: Prometheus, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A short mixed-tier locust run plus a little extra traffic: prefix-cache hits, embeddings,
    and a rate-limited key (so rejections have a reason)."""
    env = dict(os.environ)
    for tier in TIERS:
        env[f"SERVE_APP_KEY_{tier.upper()}"] = create_key(stack.keys_file, f"obs-{tier}", tier, ["*"])
    limited = create_key(stack.keys_file, "obs-limited", "batch", ["*"], limits={"rpm": 1})
    stack.wait_keys(accepted=[*(env[f"SERVE_APP_KEY_{t.upper()}"] for t in TIERS), limited])
    statuses = []
    with httpx.Client(base_url=stack.base_url, timeout=60) as c:
        prompt = "The quick brown fox jumps over the lazy dog. " * 30
        for _ in range(3):  # one prompt three times: prefix-cache hits
            h = {"Authorization": f"Bearer {env['SERVE_APP_KEY_PREMIUM']}"}
            c.post("/chat/completions", headers=h, json={
                "model": "tiny-chat", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4,
            }).raise_for_status()
        for tier in TIERS:
            h = {"Authorization": f"Bearer {env[f'SERVE_APP_KEY_{tier.upper()}']}"}
            c.post("/embeddings", headers=h, json={"model": "minilm-embed", "input": "a cat"}).raise_for_status()
        for _ in range(3):
            r = c.post("/chat/completions", headers={"Authorization": f"Bearer {limited}"}, json={
                "model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            statuses.append(r.status_code)
    assert 429 in statuses, statuses
    with httpx.Client(base_url=stack.base_url, timeout=60) as c:  # a failed authentication: audited
        assert c.get("/models", headers={"Authorization": "Bearer sk-sa-not-a-key"}).status_code == 401
    _small_batch(stack.base_url, env["SERVE_APP_KEY_BATCH"])
    time.sleep(EXPORT_DELAY_S)  # that traffic is exported before the locust window opens

    sla_json = tmp_path_factory.mktemp("locust") / "sla.json"
    clients = {t: create_key(stack.keys_file, f"obs-client-{t}", t, ["*"]) for t in TIERS}
    stack.wait_keys(accepted=list(clients.values()))
    t_start = time.time()
    # The README's mixed-tier load and, beside it, a light independent client per tier
    # (its own key, one streaming request every CLIENT_EVERY_S, its own clock).
    proc = subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests/locustfile.py"),
         "--app-config", str(stack.workdir / "serve.yaml"), "--model", "tiny-chat",
         "--max-output-tokens", "32", "--host", stack.root_url, "--headless", "-u", str(USERS), "-r", "3",
         "-t", f"{LOAD_S}s", "--only-summary", "--sla-json", str(sla_json)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        logs, refused = asyncio.run(_light_clients(stack.base_url, clients, proc))
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    t_end = time.time()
    assert sla_json.exists(), out[-4000:]
    time.sleep(EXPORT_DELAY_S)
    return {"t_start": t_start, "t_end": t_end, "at": time.time(), "clients": logs,
            "refused": refused,
            "sla": json.loads(sla_json.read_text()), "locust_out": out}


async def _light_clients(base_url: str, keys: dict[str, str],
                         proc: subprocess.Popen[str]) -> tuple[dict[str, ClientLog], dict[str, int]]:
    """One streaming chat request per tier every CLIENT_EVERY_S (open loop) while locust runs:
    time to the first content token, measured by this process (loadtests.bench.sla)."""
    logs = {t: ClientLog() for t in keys}
    refused = dict.fromkeys(keys, 0)
    prompts = load_prompts()
    rng = random.Random(22)
    stop = asyncio.Event()

    def failed(tier: str) -> Any:
        log = logs[tier]

        def note(exc: BaseException) -> None:
            if any(m in str(exc) for m in ("HTTP 503", "HTTP 429", "without any content")):
                # Shed or limited, or an answer with no content token (tiny-chat may stop at once):
                # nothing to time.
                refused[tier] += 1
                return
            log.errors += 1
            log.last_error = f"{exc.__class__.__name__}: {exc}"[:300]
        return note

    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
        url = f"{base_url}/chat/completions"
        workers = [asyncio.create_task(every(CLIENT_EVERY_S, stop, (
            lambda t=t: chat_once(client, url, keys[t], rng.choice(prompts), 32, logs[t])),
            CLIENT_TIMEOUT_S, failed(t))) for t in keys]
        while proc.poll() is None:
            await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*workers)
    return logs, refused


def _small_batch(base_url: str, key: str) -> None:
    """Two lines through /v1/batches, so the Batch API's progress series exist."""
    import openai

    sdk = openai.OpenAI(base_url=base_url, api_key=key)
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    lines = "\n".join(json.dumps({"custom_id": f"obs-{i}", "method": "POST",
                                  "url": "/v1/chat/completions", "body": body}) for i in range(2))
    f = sdk.files.create(file=("obs.jsonl", lines.encode()), purpose="batch")
    batch = sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    deadline = time.time() + 120
    while sdk.batches.retrieve(batch.id).status != "completed":
        assert time.time() < deadline, "the observability batch did not complete in 120 s"
        time.sleep(1)


def _finite(result: list[dict[str, Any]]) -> int:
    return sum(1 for s in result if math.isfinite(float(s["value"][1])))


def test_ray_export_is_scraped_with_engine_and_gateway_series(prom: Prometheus, load) -> None:
    q = PromQL(prom.url)
    targets = q.targets()
    assert targets and all(t["health"] == "up" for t in targets), targets
    names = set(q.series_names())
    engine = sorted(n for n in names if n.startswith("ray_vllm_"))
    gateway = sorted(n for n in names if n.startswith("ray_serve_app_"))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "series-names.txt").write_text("\n".join(sorted(
        n for n in names if n.startswith(("ray_vllm_", "ray_serve_")))) + "\n")
    print(f"\n[observability] {len(engine)} ray_vllm_* and {len(gateway)} ray_serve_app_* series names")
    for name in set(ENGINE_METRICS) - EVENT_ONLY:
        want = name + "_count" if ENGINE_METRICS[name] == "histogram" else name
        assert want in names, f"{want} not scraped; vLLM exported: {engine}"
    for name in SERVE_METRICS:
        assert name in names, name
    for name, m in METRICS.items():
        want = exported(name) + ("_count" if m["kind"] == "histogram" else "")
        if name not in ONLY_WHEN_USED:
            assert want in names, f"{want} not scraped; gateway exported: {gateway}"
    per_model = {s["metric"].get("model_name", ""): int(float(s["value"][1])) for s in
                 q.query('count by (model_name) ({__name__=~"ray_vllm_.+"})')}
    print(f"[observability] ray_vllm_* series per model: {per_model}")
    for model in per_model:
        got = sorted({s["metric"]["__name__"] for s in q.query(
            f'{{model_name="{model}",__name__=~"ray_vllm_.+"}}')})
        print(f"[observability] {model}: {got}")
    samples = {s["metric"].get("model_name", ""): s["value"][1] for s in q.query(
        "sum by (model_name) (count_over_time(ray_vllm_num_requests_running[10m]))")}
    print(f"[observability] samples of ray_vllm_num_requests_running in 10m: {samples}")
    # Engine series carry the model and the Ray Serve replica.
    running = q.query("ray_vllm_num_requests_running")
    assert "tiny-chat" in {s["metric"]["model_name"] for s in running}
    assert all(s["metric"].get("ReplicaId") for s in running)


def test_every_panel_query_returns_data(prom: Prometheus, load) -> None:
    q = PromQL(prom.url)
    cfg = load_app_config(ROOT / "configs/local.yaml")
    window = f"{int(load['at'] - load['t_start']) + 30}s"  # the whole run, whatever its length
    counts: list[dict[str, Any]] = []
    empty = []
    for board in boards(cfg):
        for panel in board.panels():
            n = 0
            for t in panel.targets:
                n += _finite(q.query(concrete(t.expr, window), at=load["at"]))
            counts.append({"board": board.title, "panel": panel.title, "series": n})
            if n == 0:
                empty.append(f"{board.title} / {panel.title}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "panel-series.json").write_text(json.dumps(counts, indent=1))
    print("\n[observability] series per panel:")
    for c in counts:
        print(f"  {c['series']:3d}  {c['board']} / {c['panel']}")
    assert not empty, f"panels with no data: {empty}"


def test_every_alert_expression_evaluates(prom: Prometheus, load) -> None:
    q = PromQL(prom.url)
    import yaml

    doc = yaml.safe_load((DASH / "alerts.yaml").read_text())
    exprs = [(r["alert"], r["expr"]) for g in doc["groups"] for r in g["rules"]]
    for _, expr in exprs:
        q.query(expr, at=load["at"])  # raises on a PromQL error
    deadline = time.monotonic() + 30
    while True:
        rules = q.rules()
        if len(rules) == len(exprs) and all(r.get("lastEvaluation", "").startswith("2") and
                                            not r["lastEvaluation"].startswith("0001") for r in rules):
            break
        assert time.monotonic() < deadline, rules
        time.sleep(1)
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad
    firing = sorted({(r["name"], r["state"]) for r in rules if r["state"] != "inactive"})
    print(f"\n[observability] {len(rules)} rules evaluated by Prometheus, all healthy; not inactive: {firing}")


def test_prometheus_agrees_with_locust_and_an_independent_client(prom: Prometheus, load) -> None:
    """Per tier: Prometheus's verdict is locust's, and Prometheus's TTFT p95 agrees with the light
    client's, which timed its own requests (issue 22: every clock starts at the front door): it
    lies within the 95 % confidence interval of the client's p95 (its sample is small), or within
    20 % (or 100 ms, whichever is larger) of the interval's ends. Locust's p95 is shown beside."""
    q = PromQL(prom.url)
    window = f"{int(load['at'] - load['t_start']) + 2}s"
    for t in load["sla"]["tiers"]:
        tier = t["tier"]
        got = {}
        for kind, metric in (("ttft", TTFT), ("tpot", TPOT)):
            expr = (f'histogram_quantile(0.95, sum by (le) (increase({metric}_bucket'
                    f'{{tier="{tier}",model="tiny-chat"}}[{window}])))')
            res = q.query(expr, at=load["at"])
            assert res, expr
            got[kind] = float(res[0]["value"][1]) * 1000
        log: ClientLog = load["clients"][tier]
        client_p95 = percentile(log.ttft, 0.95)
        ci = quantile_interval(log.ttft, 0.95)
        print(f"\n[observability] {tier}: TTFT p95 prometheus {got['ttft']:.0f} ms, client "
              f"{client_p95 or float('nan'):.0f} ms (95 % interval {ci}; {len(log.ttft)} requests, "
              f"{load['refused'][tier]} refused or empty, {log.errors} errors), "
              f"locust {t['ttft_p95_ms']:.0f} ms; TPOT p95 prometheus {got['tpot']:.0f} ms, locust "
              f"{t['tpot_p95_ms']:.0f} ms; objectives {t['ttft_objective_ms']:.0f}/"
              f"{t['tpot_objective_ms']:.0f} ms; locust {t['status']}")
        prom_ok = (got["ttft"] <= t["ttft_objective_ms"], got["tpot"] <= t["tpot_objective_ms"])
        locust_ok = (t["ttft_p95_ms"] <= t["ttft_objective_ms"], t["tpot_p95_ms"] <= t["tpot_objective_ms"])
        assert prom_ok == locust_ok, (tier, got, t)
        assert log.errors == 0 and len(log.ttft) >= LOAD_S / CLIENT_EVERY_S / 2, (
            tier, len(log.ttft), log.errors, log.last_error)
        # The client's ~45 requests give its p95 to within an interval of order statistics, not a
        # point: Prometheus (every request) must fall in it, or within 20 % / 100 ms of its ends.
        # (A point comparison failed CI once: batch 886 ms by Prometheus, 900 by locust, 680 by the
        # client's 47 requests.)
        assert agrees_with_sample(got["ttft"], log.ttft), (tier, got["ttft"], client_p95, ci)


def test_sla_panels_render_to_png(prom: Prometheus, load) -> None:
    from loadtests.report import render

    cfg = load_app_config(stack_config := ROOT / "configs/local.yaml")
    out = ARTIFACTS / "sla-tiers.png"
    start = load["t_start"] - 60
    empty = render(PromQL(prom.url), sla_board(cfg), start, load["at"], out, window="30s")
    assert out.stat().st_size > 30_000, stack_config
    assert not empty, f"panels drawn with no data: {empty}"
    print(f"\n[observability] SLA report: {out}")


def test_prometheus_graph_page_screenshot(prom: Prometheus, load, tmp_path: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    if not Path("/usr/bin/chromium").exists():
        pytest.skip("chromium is not installed (run scripts/system-deps.sh)")
    expr = concrete(sla_board(load_app_config(ROOT / "configs/local.yaml")).rows[0][1][0].targets[0].expr, "30s")
    url = prom.url + "/graph?" + urllib.parse.urlencode(
        {"g0.expr": expr, "g0.tab": "0", "g0.range_input": "5m"})
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1000", f"--user-data-dir={tmp_path / 'chrome-profile'}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(options=opts, service=Service(executable_path="/usr/bin/chromedriver"))
    try:
        driver.get(url)  # Debian's build redirects /graph to its classic UI
        # Once the range query answers, the page says how many series it drew, and draws them (SVG).
        WebDriverWait(driver, 30).until(
            lambda d: re.search(r"Total time series: [1-9]", d.find_element(By.TAG_NAME, "body").text))
        WebDriverWait(driver, 10).until(ec.presence_of_element_located((By.CSS_SELECTOR, ".graph_area svg path")))
        time.sleep(1)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "prometheus-ttft-p95.png"
        driver.save_screenshot(str(shot))
    finally:
        driver.quit()
    assert shot.stat().st_size > 20_000
    print(f"\n[observability] Prometheus graph screenshot: {shot}")


def test_run_prometheus_flag_starts_one_beside_ray(serve_handles, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """What ``serve-app run --prometheus`` does once the app is ready (Ray connected)."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed (run scripts/system-deps.sh)")
    from serve_app.local.prometheus import start_for_ray

    prom = start_for_ray(tmp_path)
    try:
        assert prom is not None
        out = capsys.readouterr().out
        assert f"PROMETHEUS_URL={prom.url}" in out and prom.url.startswith("http://127.0.0.1:")
        q = PromQL(prom.url)
        assert len(q.rules()) == 11  # dashboards/alerts.yaml loaded
        deadline = time.monotonic() + 30
        while not any(t["health"] == "up" for t in q.targets()):
            assert time.monotonic() < deadline, q.targets()
            time.sleep(1)
    finally:
        if prom is not None:
            prom.stop()
    assert prom.proc is None


def test_premium_over_its_objective_fires_the_ttft_alert(stack, serve_handles, tmp_path: Path) -> None:
    """TierTTFTP95OverObjective fires in a real Prometheus when premium misses its TTFT objective.

    The rules are the shipped ones for the running stack's config, with two changes so that the
    test takes a minute: premium's TTFT objective is 1 ms (no request on any machine meets it, so
    premium traffic drives its p95 over it) and ``for`` is 10 s instead of 5 minutes. The other
    tiers keep their objectives and must stay silent."""
    import ray

    cfg = load_app_config(stack.config)
    premium = cfg.tiers["premium"]
    tight = premium.model_copy(update={"objectives": premium.objectives.model_copy(
        update={"ttft_p95_ms": 1})})
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump(alerts.rules(
        cfg.model_copy(update={"tiers": {**cfg.tiers, "premium": tight}}), sustained="10s")))
    sd = write_sd_file(tmp_path / "ray_sd.json", targets_from_nodes(ray.nodes()))
    p = Prometheus(tmp_path / "prom", sd, rule_files=[rules_file], scrape_interval_s=2)
    (tmp_path / "prom").mkdir()
    p.start()
    key = create_key(stack.keys_file, "alert-premium", "premium", ["*"])
    stack.wait_keys(accepted=[key])
    firing = 'ALERTS{alertname="TierTTFTP95OverObjective", alertstate="firing", tier="%s"}'
    try:
        q = PromQL(p.url)
        t0 = time.monotonic()
        fired: list[dict[str, Any]] = []
        with httpx.Client(base_url=stack.base_url, timeout=60,
                          headers={"Authorization": f"Bearer {key}"}) as c:
            while not fired and time.monotonic() - t0 < 150:
                for _ in range(5):  # premium streams (TTFT is a stream's), each far over 1 ms
                    with c.stream("POST", "/chat/completions", json={
                            "model": "tiny-chat", "max_tokens": 4, "stream": True,
                            "messages": [{"role": "user", "content": "hello"}]}) as r:
                        r.raise_for_status()
                        r.read()
                time.sleep(1)
                fired = q.query(firing % "premium")
        took = time.monotonic() - t0
        print(f"\n[observability] TierTTFTP95OverObjective for premium fired after {took:.0f} s of premium "
              f"traffic against a 1 ms objective (for: 10s)")
        assert fired, "TierTTFTP95OverObjective did not fire for premium within 150 s"
        assert q.query(firing % "batch") == []  # batch's objective (seconds) was met
    finally:
        p.stop()
