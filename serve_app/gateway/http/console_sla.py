"""The console's SLA page data: each tier's objectives, the SLO misses the usage store counts for
its keys, and its TTFT p95 over the last 5 minutes when Prometheus is known.

The gateway's latency histograms go out through Ray's metrics agent (``metrics.GatewayMetrics``):
no replica holds a p95 of its own, so the p95 is read from Prometheus
(``gateway.console.prometheus_url``), with the same query as the SLA dashboard."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import httpx

from serve_app.metrics import PREFIX, RAY_PREFIX

logger = logging.getLogger("ray.serve")
WINDOW = "5m"
QUERY = (f"histogram_quantile(0.95, sum by (le, tier) "
         f"(rate({RAY_PREFIX}{PREFIX}ttft_seconds_bucket[{WINDOW}])))")
TIMEOUT_S = 3.0


async def ttft_p95_ms(base_url: str) -> dict[str, float]:
    """Each tier's TTFT p95 in ms from Prometheus' query API; NaN answers (no traffic) left out."""
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        resp = await client.get(base_url.rstrip("/") + "/api/v1/query", params={"query": QUERY})
        resp.raise_for_status()
        out: dict[str, float] = {}
        for r in resp.json()["data"]["result"]:
            value = float(r["value"][1])
            if value == value:  # not NaN
                out[str(r["metric"].get("tier", ""))] = value * 1000
        return out


async def sla_rows(d: Any) -> tuple[list[dict[str, Any]], str | None]:
    """One row per tier, and a note on where the p95 came from (or why it is missing)."""
    counts: dict[str, dict[str, int]] = {t: {"requests": 0, "ttft": 0, "tpot": 0} for t in d.cfg.tiers}
    for key in await d.keys.records():
        c = counts.get(key.tier)
        if c is None:
            continue
        totals: Mapping[str, int] = await d.usage.store.get(key.id)
        c["requests"] += totals.get("requests", 0)
        c["ttft"] += totals.get("slo_miss_ttft", 0)
        c["tpot"] += totals.get("slo_miss_tpot", 0)
    url = d.cfg.gateway.console.prometheus_url
    p95: dict[str, float] = {}
    if url is None:
        note = ("The TTFT p95 needs Prometheus: set gateway.console.prometheus_url (the gateway's "
                "histograms are exported through Ray's metrics agent, not kept in the replica).")
    else:
        try:
            p95 = await ttft_p95_ms(url)
            note = f"TTFT p95 over the last {WINDOW}, from Prometheus."
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            logger.warning("console: Prometheus not read: %s", exc.__class__.__name__)
            note = "Prometheus did not answer; the TTFT p95 is unknown for now."
    rows = [{"tier": name, "ttft_objective_ms": tier.objectives.ttft_p95_ms,
             "tpot_objective_ms": tier.objectives.tpot_p95_ms, "ttft_p95_ms": p95.get(name),
             "requests": counts[name]["requests"], "ttft_misses": counts[name]["ttft"],
             "tpot_misses": counts[name]["tpot"]} for name, tier in d.cfg.tiers.items()]
    return rows, note
