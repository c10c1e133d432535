"""Every metric name, label set and bucket list, in one place (dashboards are generated from it).

Metrics go through Ray's metrics agent, which Prometheus scrapes on each node. Labels carry the key
id and the tier, never a secret.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray.util.metrics import Counter, Histogram

PREFIX = "serve_app_"
KEY_LABELS = ("key_id", "tier", "model")
LATENCY_BUCKETS_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
TPOT_BUCKETS_S = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2]

METRICS: dict[str, dict[str, Any]] = {
    "requests_total": {"kind": "counter", "labels": (*KEY_LABELS, "status"),
                       "help": "Requests answered by the gateway, by HTTP status."},
    "tokens_total": {"kind": "counter", "labels": (*KEY_LABELS, "type"),
                     "help": "Tokens used, type=prompt|completion."},
    "rejections_total": {"kind": "counter", "labels": (*KEY_LABELS, "reason"),
                         "help": "Requests refused before the engine: rate_limit, shed, backpressure."},
    "slo_misses_total": {"kind": "counter", "labels": (*KEY_LABELS, "objective"),
                         "help": "Requests slower than their tier's objective (ttft or tpot)."},
    "ttft_seconds": {"kind": "histogram", "labels": ("tier", "model"), "buckets": LATENCY_BUCKETS_S,
                     "help": "Time to first token, measured at the gateway."},
    "tpot_seconds": {"kind": "histogram", "labels": ("tier", "model"), "buckets": TPOT_BUCKETS_S,
                     "help": "Time per output token after the first, measured at the gateway."},
}


@dataclass
class GatewayMetrics:
    """The gateway's metric objects; ``inc``/``observe`` take label dicts."""

    requests: Counter
    tokens: Counter
    rejections: Counter
    slo_misses: Counter
    ttft: Histogram
    tpot: Histogram

    @classmethod
    def create(cls) -> GatewayMetrics:
        def make(name: str) -> Any:
            m = METRICS[name]
            if m["kind"] == "counter":
                return Counter(PREFIX + name, description=m["help"], tag_keys=m["labels"])
            return Histogram(PREFIX + name, description=m["help"], boundaries=m["buckets"],
                             tag_keys=m["labels"])

        return cls(
            requests=make("requests_total"),
            tokens=make("tokens_total"),
            rejections=make("rejections_total"),
            slo_misses=make("slo_misses_total"),
            ttft=make("ttft_seconds"),
            tpot=make("tpot_seconds"),
        )

    def request_finished(
        self,
        *,
        key_id: str,
        tier: str,
        model: str,
        status: int,
        prompt_tokens: int,
        completion_tokens: int,
        ttft_s: float | None,
        tpot_s: float | None,
        missed: tuple[str, ...],
    ) -> None:
        """One request answered (any status): its tokens, latencies and missed objectives."""
        tags = {"key_id": key_id, "tier": tier, "model": model}
        self.requests.inc(1, tags={**tags, "status": str(status)})
        if prompt_tokens:
            self.tokens.inc(prompt_tokens, tags={**tags, "type": "prompt"})
        if completion_tokens:
            self.tokens.inc(completion_tokens, tags={**tags, "type": "completion"})
        for objective in missed:
            self.slo_misses.inc(1, tags={**tags, "objective": objective})
        lat = {"tier": tier, "model": model}
        if ttft_s is not None:
            self.ttft.observe(ttft_s, tags=lat)
        if tpot_s is not None:
            self.tpot.observe(tpot_s, tags=lat)

    def request_rejected(self, *, key_id: str, tier: str, model: str, reason: str) -> None:
        """One request refused before the engine: rate_limit, shed or backpressure."""
        self.rejections.inc(1, tags={"key_id": key_id, "tier": tier, "model": model,
                                     "reason": reason})
