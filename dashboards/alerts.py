"""SLO alert rules (Prometheus rule file) from the config's tiers and models.

Thresholds come from the config, so a changed objective changes its alert; the expressions use the
same series and quantiles as the SLA dashboard.
"""

from __future__ import annotations

from typing import Any

from dashboards.queries import REJECTIONS, REQUESTS, TPOT, TTFT
from serve_app.config import AppConfig

SUSTAINED = "5m"  # a tier over its objective for this long fires
WINDOW = "5m"  # rate window of the p95
KV_CACHE_FULL = 0.9
ERROR_RATE = 0.05


def top_tier(cfg: AppConfig) -> str:
    """The tier that is never meant to be refused: the lowest vLLM priority (runs first)."""
    return min(cfg.tiers.items(), key=lambda kv: (kv[1].priority, kv[0]))[0]


def _p95(metric: str, tier: str) -> str:
    return (f'histogram_quantile(0.95, sum by (le, model) (rate({metric}_bucket{{tier="{tier}"}}'
            f"[{WINDOW}])))")


def rules(cfg: AppConfig, sustained: str = SUSTAINED) -> dict[str, Any]:
    """The rule file for ``cfg``; ``sustained`` is how long a tier must stay over an objective
    (a test shortens it to see the alert fire)."""
    slo: list[dict[str, Any]] = []
    for name, tier in sorted(cfg.tiers.items(), key=lambda kv: kv[1].priority):
        o = tier.objectives
        for kind, metric, objective_s in (("TTFT", TTFT, o.ttft_p95_ms / 1000),
                                          ("TPOT", TPOT, o.tpot_p95_ms / 1000)):
            slo.append({
                "alert": f"Tier{kind}P95OverObjective",
                "expr": f"{_p95(metric, name)} > {objective_s:g}",
                "for": sustained,
                "labels": {"severity": "warning", "tier": name},
                "annotations": {
                    "summary": f"Tier {name}: {kind} p95 over its {objective_s:g} s objective",
                    "description": f"{kind} p95 of {{{{ $labels.model }}}} for tier {name} is "
                                   f"{{{{ $value | humanizeDuration }}}} (objective {objective_s:g} s) "
                                   f"for {sustained}.",
                },
            })
    top = top_tier(cfg)
    slo.append({
        "alert": "TopTierRejected",
        "expr": f'sum by (model, reason) (increase({REJECTIONS}{{tier="{top}"}}[{WINDOW}])) > 0',
        "labels": {"severity": "critical", "tier": top},
        "annotations": {
            "summary": f"Tier {top} is being refused ({{{{ $labels.reason }}}})",
            "description": f"{{{{ $value | printf \"%.0f\" }}}} {top} requests to {{{{ $labels.model }}}} were refused "
                           f"({{{{ $labels.reason }}}}) in the last {WINDOW}; the top tier should "
                           f"never be shed or rate-limited.",
        },
    })
    slo.append({
        "alert": "GatewayErrorRateHigh",
        "expr": (f'sum by (model) (rate({REQUESTS}{{status=~"5..",status!="503"}}[{WINDOW}])) / '
                 f"sum by (model) (rate({REQUESTS}[{WINDOW}])) > {ERROR_RATE:g}"),
        "for": "5m",
        "labels": {"severity": "critical"},
        "annotations": {
            "summary": f"Gateway error rate above {ERROR_RATE:.0%}",
            "description": "{{ $value | humanizePercentage }} of requests to {{ $labels.model }} "
                           "end in a 5xx other than 503 (503 is deliberate shedding).",
        },
    })
    capacity: list[dict[str, Any]] = []
    for m in cfg.models:
        sel = f'deployment="{m.deployment_name}"'
        capacity.append({
            "alert": "ModelNoHealthyReplica",
            "expr": (f"sum(ray_serve_deployment_replica_healthy{{{sel}}}) < 1 "
                     f"or absent(ray_serve_deployment_replica_healthy{{{sel}}})"),
            "for": "1m",
            "labels": {"severity": "critical", "model": m.id},
            "annotations": {"summary": f"Model {m.id} has no healthy replica",
                            "description": f"Deployment {m.deployment_name} has had no healthy "
                                           "replica for 1m: its requests fail or fall back."},
        })
    capacity.append({
        "alert": "KVCacheAlmostFull",
        "expr": f"max by (model_name, ReplicaId) (ray_vllm_kv_cache_usage_perc) > {KV_CACHE_FULL:g}",
        "for": "5m",
        "labels": {"severity": "warning"},
        "annotations": {"summary": "KV cache of {{ $labels.model_name }} above 90%",
                        "description": "Replica {{ $labels.ReplicaId }} of {{ $labels.model_name }} "
                                       "has used {{ $value | humanizePercentage }} of its KV cache "
                                       "for 5m; requests will queue or be preempted."},
    })
    return {"groups": [
        {"name": "serve-app-slo", "rules": slo},
        {"name": "serve-app-capacity", "rules": capacity},
    ]}
