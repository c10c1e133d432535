"""The console's replicas page data: each model's running replicas as this gateway sees them
(``LiveReplicas``: Ray Serve's RUNNING replicas and their endpoints), its adapters (configured
and added at run time),
and, when Prometheus is known (``gateway.console.prometheus_url``), each replica's engine figures
from the engine's own ``ray_vllm_*`` series: requests running and waiting, KV cache use, the
prefix cache's hit rate over the last 5 minutes and the LoRA adapters it runs now. These are the
series the dashboards read, by the same labels (``model_name``, ``ReplicaId``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import httpx

from serve_app.gateway.http.console_sla import TIMEOUT_S, WINDOW

logger = logging.getLogger("ray.serve")
BY = "model_name, ReplicaId"
QUERIES = {
    "running": f"sum by ({BY}) (ray_vllm_num_requests_running)",
    "waiting": f"sum by ({BY}) (ray_vllm_num_requests_waiting)",
    "kv_cache": f"max by ({BY}) (ray_vllm_kv_cache_usage_perc)",
    "hit_rate": (f"sum by ({BY}) (rate(ray_vllm_prefix_cache_hits_total[{WINDOW}])) / "
                 f"sum by ({BY}) (rate(ray_vllm_prefix_cache_queries_total[{WINDOW}]))"),
    # vLLM's info gauge: its value is when it was set, its labels name the adapters running
    # and waiting; the newest series per replica is the one that holds now.
    "adapters": f"max by ({BY}, running_lora_adapters) (ray_vllm_lora_requests_info)",
}
Row = dict[str, Any]


async def engine_figures(base_url: str) -> dict[tuple[str, str], Row]:
    """(model, replica id) -> the replica's figures, from Prometheus' query API. A NaN (no
    prefix-cache queries in the window) is left out."""
    out: dict[tuple[str, str], Row] = {}
    newest: dict[tuple[str, str], float] = {}
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        answers = await asyncio.gather(*(
            client.get(base_url.rstrip("/") + "/api/v1/query", params={"query": q})
            for q in QUERIES.values()))
    for name, resp in zip(QUERIES, answers, strict=True):
        resp.raise_for_status()
        for r in resp.json()["data"]["result"]:
            labels = r["metric"]
            where = (str(labels.get("model_name", "")), str(labels.get("ReplicaId", "")))
            value = float(r["value"][1])
            if value != value:  # NaN
                continue
            row = out.setdefault(where, {})
            if name == "adapters":
                if value >= newest.get(where, float("-inf")):
                    newest[where] = value
                    names = str(labels.get("running_lora_adapters", ""))
                    row["adapters"] = sorted(a for a in names.split(",") if a)
            else:
                row[name] = value
    return out


async def replica_rows(d: Any, replicas: Any) -> tuple[list[Row], str]:
    """One row per model replica (the gateway's view joined with Prometheus' when it is known),
    and a note on where the engine figures came from (or why they are missing)."""
    figures: dict[tuple[str, str], Row] = {}
    url = d.cfg.gateway.console.prometheus_url
    if url is None:
        note = ("The engine figures need Prometheus: set gateway.console.prometheus_url (the "
                "engines export them through Ray's metrics agent).")
    else:
        try:
            figures = await engine_figures(url)
            note = f"Engine figures from Prometheus; the hit rate is over the last {WINDOW}."
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            logger.warning("console: Prometheus not read: %s", exc.__class__.__name__)
            note = "Prometheus did not answer; the engine figures are unknown for now."
    runtime = d.router.runtime.all() if d.router.runtime is not None else []
    rows: list[Row] = []
    for m in d.cfg.models:
        endpoints: Mapping[str, tuple[str, int]] = replicas.endpoints(m.id) if replicas else {}
        ids = sorted(set(endpoints) | {r for (model, r) in figures if model == m.id})
        configured = [a.name for a in m.adapters] + [a.name for a in runtime if a.model == m.id]
        if not ids:
            rows.append({"model": m.id, "replica": None, "endpoint": None, "adapters_configured": configured})
        for rid in ids:
            host_port = endpoints.get(rid)
            rows.append({"model": m.id, "replica": rid,
                         "endpoint": None if host_port is None else f"{host_port[0]}:{host_port[1]}",
                         "adapters_configured": configured, **figures.get((m.id, rid), {})})
    return rows, note
