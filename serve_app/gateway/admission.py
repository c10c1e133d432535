"""Admission: a key's tier decides its limits, its scheduling priority and when it is shed.

``Admission.admit`` runs before a request reaches a model. It clamps ``max_tokens`` to the tier's
cap, takes a slot on the first candidate model with room, reserves tokens, and charges every
configured limit at once (key and tier, RPM, TPM and concurrency). The returned ``Ticket`` is
settled exactly once when the request ends, with the real token usage.

A model has room for a key when its in-flight requests (this replica's count, scaled to all
gateway replicas) are below both its capacity (``max_ongoing_requests`` x running replicas +
``max_queued_requests``; 503 for every tier) and its tier's share of ``saturation_requests`` (503
for that tier). ``saturation_requests`` is given for the model at its largest (``max_replicas``),
and both bounds follow the replicas running now (``replicas.LiveReplicas``), so that an
autoscaled model running one replica sheds batch at the right point and grows its bounds when it
scales up. A model with no running replica is refused with 503 at once (the forwarder's outage
guard holds only requests admitted before their model went down). The gateway enforces the
capacity itself: Ray Serve's ``max_queued_requests`` is counted per caller and only for requests waiting to be routed, so a burst can pass it. The slot is
taken in the same step as the check, with no ``await`` between, so a burst cannot pass it here.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from serve_app import errors
from serve_app.config import AppConfig, KeyRecord, Limits, TierConfig
from serve_app.gateway.limits import Charge, LimitBackend, Verdict, clock
from serve_app.gateway.replicas import LiveReplicas

logger = logging.getLogger("ray.serve")

DEFAULT_RESERVE_TOKENS = 1024
_BYTES_PER_TOKEN = 4  # a rough prompt estimate for the reservation; settled to the truth later


@dataclass
class Ticket:
    """What one admitted request holds: refunded or settled when it ends."""

    model_id: str
    reserved_tokens: int
    completion_tokens: int
    token_charges: list[Charge] = field(default_factory=list)
    gauges: list[Charge] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    settled: bool = False


def _fmt_reset(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.3g}s" if s < 10 else f"{round(s)}s"
    return f"{int(s // 60)}m{round(s % 60)}s"


def _requested_max_tokens(body: dict[str, Any]) -> Any:
    # Chat's two names, and the Responses API's (the Messages API uses max_tokens).
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        if body.get(name) is not None:
            return name, body[name]
    return "max_tokens", None


class Admission:
    """Limits and shedding for one gateway replica (counters may be shared through Redis)."""

    def __init__(self, cfg: AppConfig, backend: LimitBackend,
                 replicas: LiveReplicas | None = None) -> None:
        self.cfg = cfg
        self.backend = backend
        self.replicas = replicas
        self.inflight: dict[str, int] = defaultdict(int)
        self._models = {m.id: m for m in cfg.models}
        self._context = {m.id: m.engine.max_model_len for m in cfg.models}

    def running(self, model_id: str) -> int:
        """Replicas of the model running now, or its configured count while that is unknown."""
        live = self.replicas.running(model_id) if self.replicas is not None else None
        if live is not None:
            return live
        m = self._models.get(model_id)
        return m.deployment.most_replicas if m is not None else 1

    def bounds(self, model_id: str) -> tuple[int | None, float | None]:
        """(capacity, saturation) of the model for the replicas running now; None: unbounded."""
        m = self._models.get(model_id)
        if m is None:
            return None, None
        running = self.running(model_id)
        capacity = m.deployment.capacity_with(running)
        sat = m.admission.saturation_requests
        most = m.deployment.most_replicas
        saturation = None if sat is None else sat * min(running, most) / most
        return capacity, saturation

    def tier(self, key: KeyRecord) -> TierConfig:
        return self.cfg.tiers.get(key.tier) or self.cfg.tiers[self.cfg.default_tier]

    def key_limits(self, key: KeyRecord) -> Limits:
        return self.tier(key).key_limits.merged(key.limits)

    def clamp_max_tokens(self, body: dict[str, Any], key: KeyRecord) -> int:
        """Apply the tier's cap to max_tokens; return the completion tokens to reserve."""
        cap = self.key_limits(key).max_tokens_cap or self.tier(key).limits.max_tokens_cap
        name, value = _requested_max_tokens(body)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise errors.InvalidRequest(f"{name} must be a positive integer", param=name)
        if cap is not None and (value is None or value > cap):
            body[name] = cap
            return cap
        return value if value is not None else DEFAULT_RESERVE_TOKENS

    def _charges(self, key: KeyRecord, tokens: int) -> tuple[list[Charge], list[int], list[int]]:
        kl, tl = self.key_limits(key), self.tier(key).limits
        charges: list[Charge] = []
        rpm_idx: list[int] = []
        tpm_idx: list[int] = []
        for scope, lim in ((f"key:{key.id}", kl), (f"tier:{key.tier}", tl)):
            if lim.max_concurrent:
                charges.append(Charge(f"{scope}:conc", 1, lim.max_concurrent, gauge=True))
            if lim.rpm:
                rpm_idx.append(len(charges))
                charges.append(Charge(f"{scope}:rpm", 1, lim.rpm))
            if lim.tpm:
                tpm_idx.append(len(charges))
                charges.append(Charge(f"{scope}:tpm", tokens, lim.tpm))
        return charges, rpm_idx, tpm_idx

    @staticmethod
    def _headers(charges: list[Charge], v: Verdict, rpm: list[int], tpm: list[int]) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers, from the key's own limits when set (else the tier's)."""
        h: dict[str, str] = {}
        for kind, idx in (("requests", rpm), ("tokens", tpm)):
            known = [i for i in idx if i < len(v.remaining)]
            if not known:
                continue
            i = known[0]
            h[f"x-ratelimit-limit-{kind}"] = str(charges[i].limit)
            h[f"x-ratelimit-remaining-{kind}"] = str(int(v.remaining[i]))
            h[f"x-ratelimit-reset-{kind}"] = _fmt_reset(v.reset_s[i])
        return h

    async def admit(
        self, key: KeyRecord, model_ids: Sequence[str], body: dict[str, Any], body_bytes: int
    ) -> Ticket:
        """Admit on the first of ``model_ids`` with room (the primary, then its fallback)."""
        completion = self.clamp_max_tokens(body, key)
        prompt = math.ceil(body_bytes / _BYTES_PER_TOKEN)
        model_id = self._take_slot(key, model_ids)
        # The engine never makes more than the context left after the prompt (agents ask for
        # 32k-64k max_tokens), so the reservation is clamped to it, and one turn does not take a
        # minute's token budget. The prompt is only estimated here; the settlement corrects it.
        context = self._context.get(model_id)
        if context:
            completion = min(completion, max(1, context - prompt))
        reserve = completion + prompt
        try:
            return await self._charge(key, model_id, reserve, completion)
        except BaseException:
            self.inflight[model_id] -= 1
            raise

    def move(self, ticket: Ticket, key: KeyRecord, model_id: str) -> None:
        """Move an admitted request to another model (its fallback) if that one has room."""
        self._take_slot(key, [model_id])
        self.inflight[ticket.model_id] -= 1
        ticket.model_id = model_id

    async def _charge(self, key: KeyRecord, model_id: str, reserve: int, completion: int) -> Ticket:
        charges, rpm, tpm = self._charges(key, reserve)
        try:
            verdict = await self.backend.admit(charges, clock())
        except Exception as exc:
            # The shared counters are unreachable: serve unlimited rather than fail the request.
            # Availability beats strictness here; the log and the missing headers show it.
            logger.error("limits not enforced, counter backend failed: %s", exc.__class__.__name__)
            verdict = Verdict(allowed=True)
            charges, rpm, tpm = [], [], []
        headers = self._headers(charges, verdict, rpm, tpm)
        if not verdict.allowed:
            failed = charges[verdict.failed]
            wait = max(verdict.retry_after_s, 0.001)
            if failed.counter.endswith(":tpm") and reserve > failed.limit:
                raise errors.InvalidRequest(
                    f"this request may use {reserve} tokens, more than the {failed.limit} tokens per "
                    "minute allowed; lower max_tokens",
                    param="max_tokens",
                )
            what = {"conc": "concurrent requests", "rpm": "requests per minute",
                    "tpm": "tokens per minute"}[failed.counter.rsplit(":", 1)[1]]
            scope = "key" if failed.counter.startswith("key:") else f"tier {key.tier!r}"
            raise errors.RateLimited(
                f"Rate limit reached for {what} ({failed.limit}) on this {scope}. "
                f"Retry in {wait:.2f} s.",
                headers={
                    **headers,
                    "Retry-After": str(max(1, math.ceil(wait))),
                    "retry-after-ms": str(max(1, math.ceil(wait * 1000))),
                },
            )
        return Ticket(
            model_id=model_id,
            reserved_tokens=reserve,
            completion_tokens=completion,
            token_charges=[charges[i] for i in tpm],
            gauges=[c for c in charges if c.gauge],
            headers=headers,
        )

    def _take_slot(self, key: KeyRecord, model_ids: Sequence[str]) -> str:
        """Count the request in flight on the first model with room, or raise the first refusal."""
        refusals = []
        for model_id in model_ids:
            refusal = self._refusal(key, model_id)
            if refusal is None:
                self.inflight[model_id] += 1
                return model_id
            refusals.append(refusal)
        raise refusals[0]

    def _refusal(self, key: KeyRecord, model_id: str) -> errors.ServiceUnavailable | None:
        # Each gateway replica sees its share of the traffic; scale its count to the whole.
        load = self.inflight[model_id] * self.cfg.gateway.num_replicas
        retry = self.cfg.gateway.retry_after_s
        if self.running(model_id) == 0:
            return errors.ServiceUnavailable(
                f"model {model_id!r} has no running replica. Retry shortly.", retry_after_s=retry,
            )
        capacity, saturation = self.bounds(model_id)
        if capacity is not None and load >= capacity:
            return errors.ServiceUnavailable(
                f"model {model_id!r} is at capacity ({capacity} requests running or queued). "
                "Retry shortly.",
                retry_after_s=retry,
            )
        tier = self.tier(key)
        if saturation is not None and tier.shed_at < 1.0 and load >= tier.shed_at * saturation:
            return errors.Shed(
                f"model {model_id!r} is saturated; tier {key.tier!r} is shed first. Retry shortly.",
                retry_after_s=retry,
            )
        return None

    async def settle(self, ticket: Ticket, used_tokens: int | None) -> None:
        """Release concurrency and refund the unused token reservation (or charge the overrun)."""
        if ticket.settled:
            return
        ticket.settled = True
        self.inflight[ticket.model_id] -= 1
        refunds = list(ticket.gauges)
        if used_tokens is not None:
            delta = ticket.reserved_tokens - used_tokens
            refunds += [Charge(c.counter, delta, c.limit) for c in ticket.token_charges if delta]
        try:
            await self.backend.refund(refunds, clock())
        except Exception:  # a lost refund only makes limits stricter for a minute; never fail the request
            logger.warning("limit settlement failed", exc_info=True)
