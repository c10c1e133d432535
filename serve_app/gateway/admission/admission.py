"""Admission: a key's tier decides its limits, its scheduling priority and when it is shed.

``Admission.admit`` runs before a request reaches a model, composing three parts:

1. the tier policy (``tiers``) clamps the endpoint's max-token field to the tier's cap,
2. the capacity (``capacity``) takes a slot on the first candidate model with room (503 when
   none has; a batch tier is shed first); for a model with ``flow.enabled``, the flow queue
   (``flow``) takes a slot if one is free under its bound, or else a place in its queue,
3. the limit charge (``charge``) reserves tokens and charges every configured limit at once
   (key and tier, RPM, TPM and concurrency).

``Admission.queue`` then waits for a queued request's slot (the ``queue`` stage; nothing to wait
for without a flow queue); a request that times out there, or leaves, is refunded its charge.
The returned ``Ticket`` is settled exactly once when the request ends, with the real token usage.
A model with no running replica is not refused here: the forwarder's outage guard holds such a
request at most ``gateway.unavailable_hold_s`` (``capacity``, ``outage``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from serve_app.config import AppConfig, KeyRecord, TierConfig
from serve_app.gateway.accounting.timing import StageClock
from serve_app.gateway.admission import charge
from serve_app.gateway.admission.capacity import Capacity
from serve_app.gateway.admission.flow import Flow, Waiter
from serve_app.gateway.admission.limits import Charge, LimitBackend, clock
from serve_app.gateway.admission.tiers import TierPolicy
from serve_app.gateway.routing.replicas import LiveReplicas
from serve_app.protocol import MAX_TOKENS_FIELDS, Endpoint

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
    waiter: Waiter | None = None  # its slot, or its place in a flow queue
    clock: StageClock | None = None  # its stages: the flow queue learns from the engine's TTFT


class Admission:
    """Limits and shedding for one gateway replica (counters may be shared through Redis)."""

    def __init__(self, cfg: AppConfig, backend: LimitBackend,
                 replicas: LiveReplicas | None = None) -> None:
        self.cfg = cfg
        self.backend = backend
        self.replicas = replicas
        self.tiers = TierPolicy(cfg)
        self.capacity = Capacity(cfg, replicas)
        self.flow = Flow(cfg, self.capacity)
        self._context = {m.id: m.engine.max_model_len for m in cfg.models}

    @property
    def inflight(self) -> dict[str, int]:
        return self.capacity.inflight

    def running(self, model_id: str) -> int:
        return self.capacity.running(model_id)

    def bounds(self, model_id: str) -> tuple[int | None, float | None]:
        return self.capacity.bounds(model_id)

    def tier(self, key: KeyRecord) -> TierConfig:
        return self.tiers.tier(key)

    async def admit(
        self, key: KeyRecord, model_ids: Sequence[str], body: dict[str, Any], body_bytes: int,
        endpoint: Endpoint | None = None,
    ) -> Ticket:
        """Admit on the first of ``model_ids`` with room (the primary, then its fallback).

        ``endpoint`` names the body's max-token fields; without it, every endpoint's are read."""
        fields = endpoint.max_tokens_fields if endpoint is not None else MAX_TOKENS_FIELDS
        budget = self.tiers.clamp_max_tokens(body, key, fields)
        prompt = math.ceil(body_bytes / _BYTES_PER_TOKEN)
        tier = self.tiers.tier(key)
        # The flow queue's deficit round-robin weighs a request by its reservation on the primary.
        waiter = self.flow.reserve(model_ids, key.tier, tier, key.tenant_id,
                                   self._reservation(model_ids[0], budget.tokens, prompt)[1])
        model_id = waiter.model_id
        completion, reserve = self._reservation(model_id, budget.tokens, prompt)
        try:
            hold = await charge.charge(self.backend, key, self.tiers.key_limits(key), tier.limits,
                                       reserve, budget.field, clock())
        except BaseException:
            self.flow.withdraw(waiter)
            raise
        return Ticket(model_id, reserve, completion, hold.token_charges, hold.gauges, hold.headers,
                      waiter=waiter)

    def _reservation(self, model_id: str, budget: int, prompt: int) -> tuple[int, int]:
        """(completion, completion + prompt) tokens to reserve on ``model_id``."""
        # The engine never makes more than the context left after the prompt (agents ask for
        # 32k-64k max_tokens), so the reservation is clamped to it, and one turn does not take a
        # minute's token budget. The prompt is only estimated here; the settlement corrects it.
        completion = budget
        context = self._context.get(model_id)
        if context:
            completion = min(completion, max(1, context - prompt))
        return completion, completion + prompt

    async def queue(self, ticket: Ticket, stage_clock: StageClock | None = None) -> bool:
        """Wait for the ticket's slot if it is queued (``flow``); at once otherwise. A request
        that waits past its tier's bound (503 with Retry-After) or leaves meanwhile takes nothing
        with it: its place or slot is given back and its charge refunded in full. True when the
        ticket's model has a flow queue (its wait is the ``queue`` stage, 0 when a slot was free)."""
        ticket.clock = stage_clock
        if ticket.waiter is None:
            return False
        try:
            await self.flow.wait(ticket.waiter)
        except BaseException:
            await asyncio.shield(self.settle(ticket, 0))
            raise
        return self.flow.enabled(ticket.model_id)

    def move(self, ticket: Ticket, key: KeyRecord, model_id: str) -> None:
        """Move an admitted request to another model (its fallback) if that one has room now."""
        self.flow.take_now(model_id, key.tier, self.tiers.tier(key))
        self.flow.release(ticket.model_id)
        if ticket.waiter is not None:
            ticket.waiter.model_id = model_id
        ticket.model_id = model_id

    async def settle(self, ticket: Ticket, used_tokens: int | None) -> None:
        """Release concurrency and refund the unused token reservation (or charge the overrun)."""
        if ticket.settled:
            return
        ticket.settled = True
        if ticket.waiter is None:
            self.capacity.release(ticket.model_id)
        else:
            if ticket.waiter.granted and ticket.clock is not None:
                stages = ticket.clock.durations()
                if "engine" in stages:
                    self.flow.observe(ticket.model_id, ticket.waiter.band,
                                      stages.get("handle", 0.0) + stages["engine"])
            self.flow.withdraw(ticket.waiter)
        await charge.refund(self.backend, ticket.gauges, ticket.token_charges,
                            ticket.reserved_tokens, used_tokens, clock())
