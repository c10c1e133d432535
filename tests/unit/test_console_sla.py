"""The console's SLA page data (``console_sla``): its PromQL read of each tier's TTFT p95.

Two servers stand in for the production side. A tiny local HTTP server answers in the query
API's JSON shape (what is sent, how the answer is read, what happens when Prometheus fails); and
a real ``prometheus`` (``serve_app.local.prometheus``) scrapes a tiny exporter of the gateway's
TTFT histogram under the name Ray's metrics agent gives it, so the query itself runs in
Prometheus against that name. Neither starts Ray."""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from serve_app.gateway.http.console_sla import QUERY, sla_rows, ttft_p95_ms
from serve_app.gateway.keys.ops import KeyOps
from serve_app.local.prometheus import Prometheus, write_sd_file
from serve_app.metrics import LATENCY_BUCKETS_S
from tests.keys import run
from tests.unit.console_client import Console
from tests.unit.test_admin_api import Admin


class Fake:
    """A local HTTP server on a free port: ``answer(path, query)`` gives (status, body); each
    request's path and query are kept in ``seen``."""

    def __init__(self, answer: Any) -> None:
        seen: list[tuple[str, dict[str, list[str]]]] = []
        self.seen = seen

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                seen.append((url.path, query))
                status, body = answer(url.path, query)
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Fake:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def _vector(*samples: tuple[dict[str, str], str]) -> dict[str, Any]:
    """A query API answer in Prometheus' shape (an instant vector)."""
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": metric, "value": [1733540000.123, value]} for metric, value in samples]}}


def test_the_p95_is_read_per_tier_in_ms_and_nan_is_left_out() -> None:
    body = _vector(({"tier": "premium"}, "0.25"), ({"tier": "standard"}, "NaN"),
                   ({"tier": "batch"}, "1.5"))
    with Fake(lambda path, q: (200, body)) as prom:
        got = run(ttft_p95_ms(prom.url + "/"))  # a trailing slash is fine
    assert got == {"premium": 250.0, "batch": 1500.0}
    path, query = prom.seen[0]
    assert path == "/api/v1/query" and query["query"] == [QUERY]
    assert "ray_serve_app_ttft_seconds_bucket[5m]" in QUERY and "by (le, tier)" in QUERY


def _sla_page(tmp_path: Path, prometheus_url: str) -> str:
    a = Admin(tmp_path, gateway={"console": {"prometheus_url": prometheus_url}})
    run(KeyOps(a.deps.keys).create("web", tier="standard"))
    with a.client:
        c = Console(a)
        c.signin(a.admin)
        page = c.get("/console/sla")
        assert page.status_code == 200
        return page.text


def test_the_sla_page_shows_prometheus_p95_beside_the_objective(tmp_path: Path) -> None:
    body = _vector(({"tier": "standard"}, "0.4321"))
    with Fake(lambda path, q: (200, body)) as prom:
        text = _sla_page(tmp_path, prom.url)
    assert "TTFT p95 over the last 5m, from Prometheus." in text
    assert '<th scope="row">standard</th>' in text and "<td>432 ms</td>" in text


@pytest.mark.parametrize("status, body", [(500, "oops"), (200, "not json"),
                                          (200, {"status": "error", "error": "bad query"})])
def test_a_failing_prometheus_leaves_the_p95_unknown(tmp_path: Path, status: int, body: Any) -> None:
    with Fake(lambda path, q: (status, body)) as prom:
        rows, note = run(sla_rows(Admin(tmp_path, gateway={"console": {"prometheus_url": prom.url}}).deps))
    assert note == "Prometheus did not answer; the TTFT p95 is unknown for now."
    assert all(r["ttft_p95_ms"] is None for r in rows)


def test_no_prometheus_url_says_what_the_p95_needs(tmp_path: Path) -> None:
    rows, note = run(sla_rows(Admin(tmp_path).deps))
    assert note is not None and "gateway.console.prometheus_url" in note
    assert [r["tier"] for r in rows] == ["standard"] and rows[0]["ttft_p95_ms"] is None


# -- a real Prometheus -------------------------------------------------------------------------

def _histogram(tier: str, n: int, le_at: float) -> str:
    """The exposition text Ray's metrics agent serves for the gateway's TTFT histogram: ``n``
    observations, all in the bucket that ends at ``le_at``."""
    lines = ["# TYPE ray_serve_app_ttft_seconds histogram"]
    for le in [*LATENCY_BUCKETS_S, float("inf")]:
        count = n if le >= le_at else 0
        le_text = "+Inf" if le == float("inf") else repr(float(le))
        lines.append(f'ray_serve_app_ttft_seconds_bucket{{tier="{tier}",model="tiny-chat",'
                     f'le="{le_text}"}} {count}')
    lines += [f'ray_serve_app_ttft_seconds_count{{tier="{tier}",model="tiny-chat"}} {n}',
              f'ray_serve_app_ttft_seconds_sum{{tier="{tier}",model="tiny-chat"}} {n * le_at}']
    return "\n".join(lines) + "\n"


@pytest.fixture
def real_prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    """Prometheus scraping a tiny exporter every second: premium's TTFTs all in the bucket that
    ends at 0.5 s, growing by 10 a scrape (so its rate is not zero)."""
    if shutil.which("prometheus") is None:  # a failure under CI (tests/conftest.py)
        pytest.skip("prometheus is not installed (run scripts/system-deps.sh)")
    start = time.monotonic()

    def metrics(path: str, q: Any) -> tuple[int, str]:
        n = 10 * (1 + int((time.monotonic() - start) * 4))
        return 200, _histogram("premium", n, 0.5)

    with Fake(metrics) as exporter:
        sd = write_sd_file(tmp_path / "sd.json", [exporter.url.removeprefix("http://")])
        prom = Prometheus(tmp_path / "prom", sd, scrape_interval_s=1)
        prom.start()
        try:
            yield prom
        finally:
            prom.stop()


def test_the_query_runs_in_a_real_prometheus(real_prometheus: Prometheus) -> None:
    deadline = time.monotonic() + 30
    got: dict[str, float] = {}
    while not got:  # two scrapes make a rate
        assert time.monotonic() < deadline, "Prometheus had no p95 after 30 s"
        time.sleep(1)
        got = run(ttft_p95_ms(real_prometheus.url))
    # every observation lies in (0.4, 0.5]: histogram_quantile interpolates inside that bucket
    assert set(got) == {"premium"}
    assert 400 < got["premium"] <= 500
    with urllib.request.urlopen(real_prometheus.url + "/api/v1/targets", timeout=5) as r:
        assert json.load(r)["data"]["activeTargets"][0]["health"] == "up"
