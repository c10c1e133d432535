"""Admission: may this request run, and what does it hold while it runs.

``Admission.enter`` is the one way in, and gives a ``Pass`` (``ledger``) whose ``exit`` is the one
way out: release, charge what ran, refund what never ran, usage and metrics, exactly once. A request
that may not run gets one ``errors.Refused`` (429 or 503, with ``Retry-After`` and the key's limit
headers), recorded as a
rejection, and holds nothing. A cancellation at any await of ``enter`` (the limit charge, the
budget reservation, the flow queue) gives back what was taken: a charge or reservation that
completes after its caller left is undone in the background.

``enter`` composes, in order (a stopping app, ``drain``, is refused first, and again after a
queue wait):

1. ``admit``: the tier policy (``tiers``) clamps the endpoint's max-token field to the tier's cap;
   the capacity (``capacity``) takes a slot on the first candidate model with room (503 when none
   has; a batch tier is shed first), or for a model with ``flow.enabled`` the flow queue (``flow``)
   takes a slot if one is free under its bound, else a place in its queue; the limit charge
   (``charge``) reserves tokens and charges every configured limit at once (key and tier, RPM, TPM
   and concurrency). What it holds is a ``Ticket``.
2. the token budgets (``budgets``) reserve the same tokens on the key's and its tenant's budgets
   (429 ``insufficient_quota`` when spent);
3. ``queue`` waits for a queued request's slot (the ``queue`` stage; nothing to wait for without a
   flow queue); past its tier's bound the request gets 503 with ``Retry-After``.

A model with no running replica is not refused here: the forwarder's outage guard holds such a
request at most ``gateway.http.unavailable_hold_s`` (``capacity``, ``outage``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from serve_app import errors
from serve_app.config import AppConfig, KeyRecord, TierConfig
from serve_app.gateway.accounting.genai import GenAiCall, request_attributes
from serve_app.gateway.accounting.timing import StageClock
from serve_app.gateway.accounting.tracecontext import TraceContext
from serve_app.gateway.accounting.usage import Usage
from serve_app.gateway.admission import charge
from serve_app.gateway.admission.budgets import BudgetHold, Budgets
from serve_app.gateway.admission.capacity import Capacity
from serve_app.gateway.admission.drain import Drain
from serve_app.gateway.admission.flow import Flow, Waiter
from serve_app.gateway.admission.ledger import Pass
from serve_app.gateway.admission.limits import Charge, LimitBackend, clock
from serve_app.gateway.admission.tiers import TierPolicy
from serve_app.gateway.routing.replicas import LiveReplicas
from serve_app.protocol import MAX_TOKENS_FIELDS, Dialect, Endpoint

_BYTES_PER_TOKEN = 4  # a rough prompt estimate for the reservation; settled to the truth later
T = TypeVar("T")
logger = logging.getLogger("ray.serve")


def rejection_reason(exc: errors.Refused) -> str:
    """The ``reason`` label of a refusal at admission (the rejections metric and usage)."""
    if isinstance(exc, errors.QuotaExceeded):
        return "budget"
    if isinstance(exc, errors.RateLimited):
        return "rate_limit"
    return "shed" if isinstance(exc, errors.Shed) else "backpressure"


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
                 replicas: LiveReplicas | None = None, usage: Usage | None = None,
                 budgets: Budgets | None = None, drain: Drain | None = None) -> None:
        self.cfg = cfg
        self.backend = backend
        self.replicas = replicas
        self.usage = usage  # where rejections and outcomes are recorded (``enter`` needs it)
        self.budgets = budgets
        self.drain = drain  # a stopping app admits nothing new (its streams finish: ``drain``)
        self._undoing: set[asyncio.Task[None]] = set()  # give-backs of work its caller left
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

    async def enter(
        self, key: KeyRecord, model_ids: Sequence[str], endpoint: Endpoint, body: dict[str, Any],
        body_bytes: int, clock: StageClock, trace: TraceContext, adapter: str | None = None,
    ) -> Pass:
        """Admit the request on the first of ``model_ids`` with room (the primary, then its
        fallback): limits, capacity, budgets, then the flow queue's wait. Marks the ``admission``
        and (with a flow queue) ``queue`` stages on ``clock``. Raises ``errors.Refused``
        (recorded as a rejection) or ``InvalidRequest`` (a reservation no limit could ever admit)
        with nothing held; a cancellation meanwhile also leaves nothing held. ``adapter``: the
        LoRA adapter the request names, which its usage and metrics name instead of the model."""
        primary = model_ids[0]
        named = adapter or primary
        usage = self.usage
        if usage is None:
            raise RuntimeError("Admission.enter needs the usage recorder (Admission(usage=...))")
        try:
            self._refuse_if_draining()
            ticket = await self.admit(key, model_ids, body, body_bytes, endpoint=endpoint)
        except errors.Refused as exc:
            await self._with_limits(exc, key, endpoint)
            await usage.rejected(key, named, rejection_reason(exc))
            raise
        hold: BudgetHold | None = None
        waiting = False  # in the flow queue's wait (a refusal there is a queue timeout)
        try:
            if self.budgets is not None:  # the admission's token reservation, on the budgets
                hold = await self._take(self.budgets.reserve(key, ticket.reserved_tokens),
                                        _settle_hold)
                if hold is not None:
                    ticket.headers.update(hold.headers)
            clock.mark("admission")
            waiting = True
            queued = await self.queue(ticket, clock)  # the model's flow queue, if it has one
            waiting = False
            self._refuse_if_draining()  # the app began to stop while it waited
        except BaseException as exc:
            await asyncio.shield(self._give_back(ticket, hold))
            if isinstance(exc, errors.Refused):
                await self._with_limits(exc, key, endpoint)
                if waiting:
                    await usage.rejected(key, adapter or ticket.model_id, "queue_timeout")
                else:
                    await usage.rejected(key, named, rejection_reason(exc))
            raise
        if queued:
            clock.mark("queue")
        fallback = model_ids[1] if len(model_ids) > 1 else None
        entry = Pass(key, self.tier(key), ticket, self, usage, fallback, clock, trace)
        entry.adapter = adapter
        if endpoint.operation:  # its trace's model-call span (accounting/genai.py)
            entry.call = GenAiCall(endpoint.operation, request_attributes(endpoint, body))
        entry.budget = hold
        return entry

    async def _with_limits(self, exc: errors.Refused, key: KeyRecord, endpoint: Endpoint) -> None:
        """Add the key's limit headers to its refusal, as they stand after it (what it took is
        given back): an agent paces itself by them on a 429 or 503 as on a 200."""
        exc.headers.update(await charge.standing(
            self.backend, key, self.tiers.key_limits(key), self.tiers.tier(key).limits,
            endpoint.dialect, clock()))

    def _refuse_if_draining(self) -> None:
        if self.drain is not None and self.drain.draining:
            raise errors.ShuttingDown("the server is shutting down; retry shortly",
                                      retry_after_s=self.cfg.gateway.http.retry_after_s)

    async def _give_back(self, ticket: Ticket, hold: BudgetHold | None) -> None:
        """Release a ticket and a budget hold that never ran (idempotent: both settle once)."""
        await self.settle(ticket, 0)
        await _settle_hold(hold)

    async def _take(self, work: Coroutine[Any, Any, T],
                    undo: Callable[[T], Awaitable[None]]) -> T:
        """``await work``, except that a cancellation of the caller does not cancel ``work``
        midway (a counter charged, its result lost): it runs to its end and is undone."""
        task = asyncio.ensure_future(work)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            give_back = asyncio.ensure_future(self._undo_when_done(task, undo))
            self._undoing.add(give_back)
            give_back.add_done_callback(self._undoing.discard)
            raise

    @staticmethod
    async def _undo_when_done(task: asyncio.Future[T], undo: Callable[[T], Awaitable[None]]) -> None:
        try:
            result = await task
        except BaseException:  # it took nothing (refused, failed)
            return
        try:
            await undo(result)
        except Exception:
            logger.warning("giving back an abandoned admission failed", exc_info=True)

    async def admit(
        self, key: KeyRecord, model_ids: Sequence[str], body: dict[str, Any], body_bytes: int,
        endpoint: Endpoint | None = None,
    ) -> Ticket:
        """Admit on the first of ``model_ids`` with room (the primary, then its fallback).

        ``endpoint`` names the body's max-token fields; without it, every endpoint's are read."""
        fields = endpoint.max_tokens_fields if endpoint is not None else MAX_TOKENS_FIELDS
        dialect: Dialect = endpoint.dialect if endpoint is not None else "openai"
        budget = self.tiers.clamp_max_tokens(body, key, fields)
        prompt = math.ceil(body_bytes / _BYTES_PER_TOKEN)
        tier = self.tiers.tier(key)
        # The flow queue's deficit round-robin weighs a request by its reservation on the primary.
        waiter = self.flow.reserve(model_ids, key.tier, tier, key.tenant_id,
                                   self._reservation(model_ids[0], budget.tokens, prompt)[1])
        model_id = waiter.model_id
        completion, reserve = self._reservation(model_id, budget.tokens, prompt)
        try:
            hold = await self._take(
                charge.charge(self.backend, key, self.tiers.key_limits(key), tier.limits,
                              reserve, budget.field, clock(), dialect),
                lambda h: charge.refund(self.backend, h.gauges, h.token_charges, reserve, 0, clock()))
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


async def _settle_hold(hold: BudgetHold | None) -> None:
    if hold is not None:
        await hold.settle(0)
