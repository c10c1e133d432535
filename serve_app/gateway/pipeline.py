"""One model request through the gateway: route, admit, forward (with fallback), account.

The HTTP routes only parse and authenticate; everything a request goes through after that is here,
in order, so the whole path reads top to bottom.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import Any

from starlette.responses import Response

from serve_app import errors
from serve_app.config import AppConfig, KeyRecord
from serve_app.gateway.admission import Admission
from serve_app.gateway.forward import Forwarder
from serve_app.gateway.routing import Router
from serve_app.gateway.usage import Outcome, Usage
from serve_app.protocol import RequestContext, total_tokens

logger = logging.getLogger("ray.serve")


class Pipeline:
    """Routes a parsed request to a model deployment under its key's tier."""

    def __init__(
        self, cfg: AppConfig, router: Router, admission: Admission, forwarder: Forwarder, usage: Usage
    ) -> None:
        self.cfg = cfg
        self.router = router
        self.admission = admission
        self.forwarder = forwarder
        self.usage = usage

    async def handle(
        self, key: KeyRecord, body: dict[str, Any], size: int, method: str, task: str
    ) -> Response:
        route = self.router.resolve(body.get("model"), key)
        if route.task != task:
            raise errors.InvalidRequest(
                f"model `{route.name}` is a {route.task} model and does not serve this endpoint",
                param="model",
            )
        model_id = route.pick()
        fallback = self.router.fallback(model_id)
        candidates = [model_id] if fallback is None else [model_id, fallback]
        try:
            ticket = await self.admission.admit(key, candidates, body, size)
        except (errors.RateLimited, errors.ServiceUnavailable) as exc:
            reason = ("rate_limit" if isinstance(exc, errors.RateLimited)
                      else "shed" if isinstance(exc, errors.Shed) else "backpressure")
            await self.usage.rejected(key, model_id, reason)
            raise
        if ticket.model_id != model_id:
            logger.warning("model %s has no room; falling back to %s", model_id, ticket.model_id)
        tier = self.admission.tier(key)
        ctx = RequestContext(
            request_id=uuid.uuid4().hex,
            key_id=key.id,
            tier=key.tier,
            priority=tier.priority,
            deadline=time.time() + self.cfg.gateway.request_timeout_s,
            tenant=key.tenant_id,
        )
        # x-request-id is set by Ray Serve's proxy (bounded by gateway/proxy_middleware.py).
        headers = {"x-served-by": ticket.model_id, **ticket.headers}
        retry = {"pending": fallback is not None and ticket.model_id != fallback}

        async def on_done(out: Outcome) -> None:
            if out.status == 503 and retry["pending"]:
                return  # the fallback attempt settles this ticket
            used = total_tokens(out.usage)
            if used is None and out.events:
                # A stream cut short: charge the prompt estimate and what was sent (~1 token/event).
                used = ticket.reserved_tokens - ticket.completion_tokens + out.events
            await self.admission.settle(ticket, used)
            if out.status == 503:
                await self.usage.rejected(key, ticket.model_id, "backpressure")
            else:
                await self.usage.finished(key, tier, ticket.model_id, out)

        try:
            return await self.forwarder.forward(ticket.model_id, method, body, ctx, headers, on_done)
        except errors.ServiceUnavailable:
            if not retry["pending"]:
                raise
        # The model refused it (Ray Serve's own queue bound, or no replica): try the fallback.
        assert fallback is not None
        retry["pending"] = False  # whatever happens next settles the ticket
        try:
            self.admission.move(ticket, key, fallback)
        except errors.ServiceUnavailable:
            await on_done(Outcome(status=503))
            raise
        logger.warning("model %s unavailable; falling back to %s", model_id, fallback)
        headers["x-served-by"] = fallback
        second = dataclasses.replace(ctx, request_id=uuid.uuid4().hex)
        return await self.forwarder.forward(fallback, method, body, second, headers, on_done)
