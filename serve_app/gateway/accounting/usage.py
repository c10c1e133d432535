"""Usage accounting per key and tier: metrics for Prometheus, totals for ``GET /v1/usage``.

The totals live in a ``state.usage.UsageStore`` (memory, Redis, or SQLite in ``gateway.state.dir``;
``state.open_state`` picks it). Next to the totals, each key's tokens are kept per model
(``m:<model>:<field>``) and per UTC day (``d:<YYYY-MM-DD>:<field>``) for the admin API.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from serve_app.config import KeyRecord, TierConfig
from serve_app.gateway.accounting.genai import AttributeValue
from serve_app.gateway.accounting.timing import StageClock, StageSink
from serve_app.gateway.accounting.tracecontext import TraceContext
from serve_app.metrics import GatewayMetrics
from serve_app.protocol import Tokens
from serve_app.state.usage import UsageStore

if TYPE_CHECKING:  # opentelemetry is imported only when an OTLP endpoint is configured
    from serve_app.gateway.accounting.otel import StageSpans

logger = logging.getLogger("ray.serve")


def detail_fields(model: str, day: str, fields: dict[str, int]) -> dict[str, int]:
    """The per-model and per-day copies of a request's token fields."""
    out: dict[str, int] = {}
    for name in ("requests", "prompt_tokens", "completion_tokens"):
        if name in fields:
            out[f"m:{model}:{name}"] = fields[name]
            out[f"d:{day}:{name}"] = fields[name]
    return out


class Usage:
    """Records each request's outcome against its key and tier."""

    def __init__(self, store: UsageStore, metrics: GatewayMetrics | None,
                 stages: StageSink | None = None, spans: StageSpans | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.clock = clock  # the UTC day of the per-day totals
        self.store = store
        self.metrics = metrics
        self.stages = stages  # the per-stage histogram (``metrics.StageMetrics``)
        self.spans = spans  # OpenTelemetry export, when ``gateway.accounting.otlp_endpoint`` is set

    def stages_finished(self, clock: StageClock, trace: TraceContext, *, tier: str, model: str,
                        call: Mapping[str, AttributeValue] | None = None,
                        call_name: str = "") -> None:
        """Where one request's time went: each stage into the histogram (and spans), once;
        ``call``: the model call's GenAI attributes (``genai``), a span of its own."""
        try:
            if self.stages is not None:
                clock.observe(self.stages, tier=tier, model=model)
            if self.spans is not None:
                self.spans.export(trace, clock, attributes={"tier": tier, "model": model},
                                  call=call, call_name=call_name)
        except Exception:  # timing must never fail a request
            logger.warning("stage timings not recorded", exc_info=True)

    async def _add(self, key_id: str, fields: dict[str, int]) -> None:
        try:
            await self.store.add(key_id, fields)
        except Exception:  # accounting must never fail a request
            logger.warning("usage not recorded for key %s", key_id, exc_info=True)

    async def rejected(self, key: KeyRecord, model: str, reason: str) -> None:
        if self.metrics:
            self.metrics.request_rejected(key_id=key.id, tier=key.tier, model=model, reason=reason)
        await self._add(key.id, {"requests": 1, f"rejected_{reason}": 1})

    async def finished(
        self,
        key: KeyRecord,
        tier: TierConfig,
        model: str,
        status: int,
        tokens: Tokens | None,
        ttft_s: float | None = None,
        duration_s: float | None = None,
    ) -> None:
        """One answered request: its tokens (the engine's counts), latencies and missed objectives."""
        prompt = tokens["prompt_tokens"] if tokens else 0
        completion = tokens["completion_tokens"] if tokens else 0
        fields = {"requests": 1, "prompt_tokens": prompt, "completion_tokens": completion}
        misses = []
        if ttft_s is not None and ttft_s * 1000 > tier.objectives.ttft_p95_ms:
            misses.append("ttft")
        tpot = None
        if ttft_s is not None and duration_s is not None and completion > 1:
            tpot = (duration_s - ttft_s) / (completion - 1)
            if tpot * 1000 > tier.objectives.tpot_p95_ms:
                misses.append("tpot")
        for m in misses:
            fields[f"slo_miss_{m}"] = 1
        if status >= 400:
            fields[f"status_{status}"] = 1
        if self.metrics:
            self.metrics.request_finished(
                key_id=key.id, tier=key.tier, model=model, status=status,
                prompt_tokens=prompt, completion_tokens=completion,
                ttft_s=ttft_s, tpot_s=tpot, missed=tuple(misses),
            )
        await self._add(key.id, {**fields, **detail_fields(model, self.day(), fields)})

    def day(self) -> str:
        return datetime.fromtimestamp(self.clock(), UTC).strftime("%Y-%m-%d")

    async def report(self, key: KeyRecord) -> dict[str, Any]:
        totals = await self.store.get(key.id)
        rejections = {k.removeprefix("rejected_"): v for k, v in totals.items() if k.startswith("rejected_")}
        misses = {k.removeprefix("slo_miss_"): v for k, v in totals.items() if k.startswith("slo_miss_")}
        return {
            "object": "usage",
            "key_id": key.id,
            "tier": key.tier,
            "requests": totals.get("requests", 0),
            "prompt_tokens": totals.get("prompt_tokens", 0),
            "completion_tokens": totals.get("completion_tokens", 0),
            "rejections": rejections,
            "slo_misses": misses,
        }
