"""One model request through the gateway: route, admit, call the model (with fallback), answer.

The HTTP routes only parse and authenticate; everything a request goes through after that is here,
in order, so the whole path reads top to bottom:

    Router.resolve -> Admission.enter (a Pass) -> Forwarder.forward (an Answer) -> Pass.exit

A request refused at admission gets one ``errors.Refused`` and holds nothing. Once admitted, its
pass exits exactly once: here when no whole answer came (after one fallback, if the model has one
and nothing ran), or by the forwarder's answer when it ends. The ``Answer`` is a domain object: the
HTTP routes and the batch runner consume it alike, and nothing here knows HTTP.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Mapping
from typing import Any

from serve_app import errors
from serve_app.config import AppConfig, KeyRecord
from serve_app.gateway.accounting.timing import StageClock
from serve_app.gateway.accounting.tracecontext import TraceContext
from serve_app.gateway.accounting.usage import Usage
from serve_app.gateway.admission.admission import Admission
from serve_app.gateway.admission.ledger import NO_TOKENS, Outcome
from serve_app.gateway.forward import Forwarder
from serve_app.gateway.routing.affinity import adapter_affinity, affinity_key
from serve_app.gateway.routing.router import Router
from serve_app.protocol import Answer, Endpoint, RequestContext

logger = logging.getLogger("ray.serve")


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
    ) -> None:
        self.cfg = cfg
        self.router = router
        self.admission = admission
        self.forwarder = forwarder
        self.usage = usage

    async def handle(
        self, key: KeyRecord, endpoint: Endpoint, body: dict[str, Any], size: int,
        clock: StageClock, trace: TraceContext, headers: Mapping[str, str] | None = None,
        affinity: str | None = None,
    ) -> Answer:
        """``clock`` runs from the request's arrival at the front door (``timing``) and has its
        ``parse_auth`` stage marked; every later stage is marked on the way down and up.
        ``affinity``: the request's affinity key when its caller knows it (a stored response's
        chain keeps its first turn's), else it is made from ``headers`` and ``body``; a LoRA
        adapter's requests always take the adapter's key (``adapter_affinity``)."""
        await self.router.refresh_for(body.get("model"), key)
        route = self.router.resolve(body.get("model"), key)
        if route.task != endpoint.task:
            raise errors.InvalidRequest(
                f"model `{route.name}` is a {route.task} model and does not serve {endpoint.path}",
                param="model",
            )
        model_id = route.pick()
        if route.adapter_root is not None:
            affinity = adapter_affinity(route.name)
        fallback = self.router.fallback(route, model_id)
        candidates = [model_id] if fallback is None else [model_id, fallback]
        admitted = await self.admission.enter(key, candidates, endpoint, body, size, clock, trace,
                                              adapter=route.name if route.adapter_root else None)
        if admitted.model_id != model_id:
            logger.warning("model %s has no room; falling back to %s", model_id, admitted.model_id)
        ctx = RequestContext(
            request_id=endpoint.id_prefix + uuid.uuid4().hex,
            key_id=key.id,
            tier=key.tier,
            priority=admitted.tier.priority,
            deadline=clock.arrival + self.cfg.gateway.http.request_timeout_s,
            tenant=key.owner,  # the prefix cache's salt: shared within an owner only
            arrival=clock.arrival,
            traceparent=trace.traceparent(),
            affinity=affinity or affinity_key(key.owner, endpoint, headers or {}, body),
            adapter=(None if route.runtime is None
                     else {"name": route.runtime.name, "source": route.runtime.source}),
        )
        # x-request-id is set by Ray Serve's proxy (bounded by gateway/http/proxy_middleware.py).
        try:
            while True:
                answer_headers = {"x-served-by": admitted.model_id, **admitted.headers}
                try:
                    return await self.forwarder.forward(admitted, endpoint, body, ctx,
                                                        answer_headers)
                except errors.ServiceUnavailable:
                    # The model refused it (no replica, or Ray Serve's own queue bound): nothing
                    # ran, so its fallback may run it.
                    unavailable = admitted.model_id
                    if not admitted.fall_back():
                        raise
                    logger.warning("model %s unavailable; falling back to %s",
                                   unavailable, admitted.model_id)
                    ctx = dataclasses.replace(ctx, request_id=endpoint.id_prefix + uuid.uuid4().hex)
        except BaseException as exc:
            await admitted.exit(_no_answer(exc))
            if isinstance(exc, errors.ServeAppError):  # its answer tells the limits, as any answer
                for name, value in admitted.headers.items():
                    exc.headers.setdefault(name, value)
            raise

    async def answer_line(self, key: KeyRecord, endpoint: Endpoint, body: dict[str, Any],
                          size: int, arrival: float) -> Answer:
        """One request that did not come over HTTP (a batch line): the same path, timed from
        ``arrival``, with a trace of its own."""
        return await self.handle(key, endpoint, body, size, StageClock(arrival),
                                 TraceContext.from_headers({}))
