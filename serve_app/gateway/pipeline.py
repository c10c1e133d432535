"""One model request through the gateway: route, admit, forward (with fallback), account.

The HTTP routes only parse and authenticate; everything a request goes through after that is here,
in order, so the whole path reads top to bottom:

    Router.resolve -> Admission.admit -> Ledger (opened) -> Forwarder.forward -> Ledger.close

A request refused at admission is recorded as a rejection and has no ledger. Once admitted, its
ledger is closed exactly once: here when no whole answer came (after one fallback, if the model
has one and nothing ran), or by the forwarder's response when the answer ends.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Mapping
from typing import Any

from starlette.responses import Response

from serve_app import errors
from serve_app.config import AppConfig, KeyRecord
from serve_app.gateway.accounting.timing import StageClock
from serve_app.gateway.accounting.tracecontext import TraceContext
from serve_app.gateway.accounting.usage import Usage
from serve_app.gateway.admission.admission import Admission
from serve_app.gateway.admission.budgets import Budgets
from serve_app.gateway.admission.ledger import NO_TOKENS, Ledger, Outcome
from serve_app.gateway.forward import Forwarder
from serve_app.gateway.routing.affinity import affinity_key
from serve_app.gateway.routing.router import Router
from serve_app.protocol import Endpoint, RequestContext

logger = logging.getLogger("ray.serve")


def _rejection_reason(exc: errors.ServeAppError) -> str:
    if isinstance(exc, errors.RateLimited):
        return "rate_limit"
    return "shed" if isinstance(exc, errors.Shed) else "backpressure"


def _no_answer(exc: BaseException) -> Outcome:
    """How a request that got no whole answer ended."""
    if isinstance(exc, errors.ServiceUnavailable):
        return Outcome(exc.status, NO_TOKENS)  # refused: nothing ran
    if isinstance(exc, errors.ServeAppError):
        # A timeout, an answer that broke off, an internal error: what the engine did is unknown.
        return Outcome(exc.status)
    return Outcome(499)  # the client went away before an answer


class Pipeline:
    """Routes a parsed request to a model deployment under its key's tier."""

    def __init__(
        self, cfg: AppConfig, router: Router, admission: Admission, forwarder: Forwarder, usage: Usage,
        budgets: Budgets | None = None,
    ) -> None:
        self.budgets = budgets
        self.cfg = cfg
        self.router = router
        self.admission = admission
        self.forwarder = forwarder
        self.usage = usage

    async def handle(
        self, key: KeyRecord, endpoint: Endpoint, body: dict[str, Any], size: int,
        clock: StageClock, trace: TraceContext, headers: Mapping[str, str] | None = None,
    ) -> Response:
        """``clock`` runs from the request's arrival at the front door (``timing``) and has its
        ``parse_auth`` stage marked; every later stage is marked on the way down and up."""
        route = self.router.resolve(body.get("model"), key)
        if route.task != endpoint.task:
            raise errors.InvalidRequest(
                f"model `{route.name}` is a {route.task} model and does not serve {endpoint.path}",
                param="model",
            )
        model_id = route.pick()
        fallback = self.router.fallback(model_id)
        candidates = [model_id] if fallback is None else [model_id, fallback]
        try:
            ticket = await self.admission.admit(key, candidates, body, size, endpoint=endpoint)
        except (errors.RateLimited, errors.ServiceUnavailable) as exc:
            await self.usage.rejected(key, model_id, _rejection_reason(exc))
            raise
        budget = None
        if self.budgets is not None:
            try:  # the admission's token reservation, on the key's and tenant's budgets
                budget = await self.budgets.reserve(key, ticket.reserved_tokens)
            except errors.QuotaExceeded:
                await self.admission.settle(ticket, 0)
                await self.usage.rejected(key, model_id, "budget")
                raise
            if budget is not None:
                ticket.headers.update(budget.headers)
        clock.mark("admission")
        try:
            queued = await self.admission.queue(ticket, clock)  # the model's flow queue, if it has one
        except errors.ServiceUnavailable:
            await self.usage.rejected(key, ticket.model_id, "queue_timeout")
            raise
        if queued:
            clock.mark("queue")
        if ticket.model_id != model_id:
            logger.warning("model %s has no room; falling back to %s", model_id, ticket.model_id)
        ledger = Ledger(key, self.admission.tier(key), ticket, self.admission, self.usage, fallback,
                        clock, trace)
        ledger.budget = budget
        ctx = RequestContext(
            request_id=uuid.uuid4().hex,
            key_id=key.id,
            tier=key.tier,
            priority=ledger.tier.priority,
            deadline=clock.arrival + self.cfg.gateway.request_timeout_s,
            tenant=key.tenant_id,
            arrival=clock.arrival,
            traceparent=trace.traceparent(),
            affinity=affinity_key(key.tenant_id, endpoint, headers or {}, body),
        )
        # x-request-id is set by Ray Serve's proxy (bounded by gateway/proxy_middleware.py).
        try:
            while True:
                headers = {"x-served-by": ledger.model_id, **ticket.headers}
                try:
                    return await self.forwarder.forward(ledger, endpoint, body, ctx, headers)
                except errors.ServiceUnavailable:
                    # The model refused it (no replica, or Ray Serve's own queue bound): nothing
                    # ran, so its fallback may run it.
                    unavailable = ledger.model_id
                    if not ledger.fall_back():
                        raise
                    logger.warning("model %s unavailable; falling back to %s",
                                   unavailable, ledger.model_id)
                    ctx = dataclasses.replace(ctx, request_id=uuid.uuid4().hex)
        except BaseException as exc:
            await ledger.close(_no_answer(exc))
            raise
