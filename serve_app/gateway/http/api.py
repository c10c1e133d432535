"""The OpenAI-compatible HTTP API. Routes are thin: parse, call, map the result."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import Lifespan

from serve_app import errors
from serve_app.bodies import check_fields, parse_body
from serve_app.config import AppConfig, KeyRecord
from serve_app.gateway.accounting.audit import Audit
from serve_app.gateway.accounting.timing import ArrivalStamp, StageClock
from serve_app.gateway.accounting.tracecontext import TraceContext
from serve_app.gateway.accounting.usage import Usage
from serve_app.gateway.admission.budgets import Budgets
from serve_app.gateway.admission.tiers import TierPolicy
from serve_app.gateway.http.admin import mount_admin
from serve_app.gateway.http.answers import to_response
from serve_app.gateway.http.console import mount_console
from serve_app.gateway.http.models import ModelCards
from serve_app.gateway.http.read import read_capped, require_json
from serve_app.gateway.http.responses import responses_router
from serve_app.gateway.keys import access
from serve_app.gateway.pipeline import Pipeline
from serve_app.gateway.responses.service import StoredResponses
from serve_app.gateway.routing.router import Router
from serve_app.protocol import BY_PATH, ENDPOINTS, Endpoint, render_error
from serve_app.state.keys import KeyStore
from serve_app.state.responses import MemoryResponseStore

if TYPE_CHECKING:
    from serve_app.batch.routes import BatchService
    from serve_app.gateway.routing.replicas import LiveReplicas

logger = logging.getLogger("ray.serve")

@dataclass
class GatewayDeps:
    """Everything the routes need, built once per gateway replica (tests swap parts of it)."""

    cfg: AppConfig
    keys: KeyStore
    router: Router
    pipeline: Pipeline
    usage: Usage
    # HAProxy is the front door and stamps each request's arrival (``timing``); behind Ray's
    # proxy actor an X-Request-Start header would be the client's own, never trusted.
    trust_arrival_stamp: bool = False
    created: int = 0  # the model cards' `created`: when the app was built (the same on every replica)
    batch: BatchService | None = None  # /v1/files and /v1/batches (serve_app.batch)
    audit: Audit | None = None  # admin actions and failed authentications (``audit``)
    budgets: Budgets | None = None  # token budgets, reported by /v1/usage (``budgets``)
    # Stored Responses (gateway/responses); None: kept in this process's memory.
    responses: StoredResponses | None = None
    # A secret every replica shares, by name (``State.shared_secret``): the console's session key.
    secrets: Callable[[str], Awaitable[bytes | None]] | None = None
    # Ray Serve's running replicas and their endpoints, as this replica reads them (the console).
    replicas: LiveReplicas | None = None


async def get_deps(request: Request) -> GatewayDeps:
    """The replica's collaborators (``build_api`` puts them on the app; tests swap them)."""
    return request.app.state.deps  # type: ignore[no-any-return]


async def authenticate(request: Request, d: GatewayDeps = Depends(get_deps)) -> KeyRecord:
    """The key the request authenticates with (Bearer or x-api-key), or 401 (expired keys too);
    an admin key gets 403 here: it serves the admin API only."""
    # async: FastAPI would run a sync dependency in a thread pool, a hop on every request.
    key = await access.identify(request, d.keys, d.audit)
    if key.role == "admin":
        raise errors.PermissionDenied("Admin keys are accepted only on the admin API (/admin/v1).")
    return key


async def read_json(request: Request, d: GatewayDeps) -> tuple[dict[str, Any], int]:
    """The JSON object body and its size in bytes (read under ``gateway.http.max_body_bytes``)."""
    require_json(request)
    raw = await read_capped(request, d.cfg.gateway.http.max_body_bytes)
    body = parse_body(raw)
    check_fields(body)
    return body, len(raw)


def build_api(deps: GatewayDeps, lifespan: Lifespan[FastAPI] | None = None) -> FastAPI:
    """The gateway's routes over ``deps``; ``lifespan`` runs at the replica's start and stop."""
    app = FastAPI(title="serve-app gateway", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.deps = deps
    if deps.responses is None:
        deps.responses = StoredResponses(MemoryResponseStore(), deps.cfg.gateway.responses,
                                         deps.keys.by_id)
    cards = ModelCards(deps.cfg, TierPolicy(deps.cfg), deps.created)

    def model_route(endpoint: Endpoint) -> Any:
        """The generic route of a model endpoint: read the JSON body, hand it to the pipeline."""
        check = endpoint.body_check

        async def route(
            request: Request, key: KeyRecord = Depends(authenticate),
            d: GatewayDeps = Depends(get_deps),
        ) -> Response:
            clock = StageClock.for_request(request.scope, trust_stamp=d.trust_arrival_stamp)
            body, size = await read_json(request, d)
            if check is not None:
                check(body)
            clock.mark("parse_auth")
            trace = TraceContext.from_headers(request.headers)
            answer = await d.pipeline.handle(key, endpoint, body, size, clock, trace,
                                             request.headers)
            return to_response(answer)

        route.__name__ = endpoint.name
        return route

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    # Claude Code probes the root of ANTHROPIC_BASE_URL (HEAD /) before its first request.
    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models(
        limit: int | None = Query(None, ge=1), after_id: str | None = Query(None),
        anthropic_version: str | None = Header(None), key: KeyRecord = Depends(authenticate),
        d: GatewayDeps = Depends(get_deps),
    ) -> dict[str, Any]:
        """The models the key may use; in Anthropic's shape for an Anthropic client."""
        routes = d.router.visible(key)
        if anthropic_version is not None:
            return cards.anthropic_listing(routes, limit, after_id)
        return cards.listing(routes, key, limit)

    @app.get("/v1/usage")
    async def usage(
        key: KeyRecord = Depends(authenticate), d: GatewayDeps = Depends(get_deps)
    ) -> dict[str, Any]:
        """The calling key's own totals: requests, tokens, rejections by reason, SLO misses,
        and its budgets' remaining tokens."""
        report = await d.usage.report(key)
        if d.budgets is not None:
            report["budget"] = await d.budgets.status(key)
        return report

    @app.get("/v1/models/{model:path}")
    async def get_model(
        model: str, anthropic_version: str | None = Header(None),
        key: KeyRecord = Depends(authenticate), d: GatewayDeps = Depends(get_deps),
    ) -> dict[str, Any]:
        route = d.router.resolve(model, key)
        if anthropic_version is not None:
            return cards.anthropic_card(route)
        return cards.card(route, key)

    for endpoint in ENDPOINTS.values():
        if endpoint.stored:
            app.include_router(responses_router(endpoint, authenticate, get_deps, read_json))
        else:
            app.add_api_route(endpoint.path, model_route(endpoint), methods=["POST"])
    mount_admin(app)
    mount_console(app)

    if deps.batch is not None:
        from serve_app.batch.routes import batch_router

        app.include_router(batch_router(authenticate))

    install_error_handlers(app)
    # Outermost, so the arrival is taken before any of the gateway's own code runs.
    app.add_middleware(ArrivalStamp)
    return app


def error_response(exc: errors.ServeAppError, request: Request | None = None) -> JSONResponse:
    """The error in its route's dialect: Anthropic's envelope on the Messages API routes."""
    endpoint = BY_PATH.get(request.url.path) if request is not None else None
    status, body, headers = render_error(endpoint, exc)
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as ``{"error": {...}}`` (Anthropic's envelope on its routes) with the
    right status; nothing leaks a traceback."""

    async def on_app_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, errors.ServeAppError)
        return error_response(exc, request)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        cls = errors.for_status(exc.status_code)
        message = {404: "Unknown path.", 405: "Method not allowed for this path."}.get(
            exc.status_code, str(exc.detail)
        )
        err = cls(message, headers=dict(exc.headers or {}))  # keeps e.g. 405's Allow header
        return error_response(err, request)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        return error_response(
            errors.InvalidRequest(first.get("msg", "invalid request"), param=".".join(loc) or None),
            request,
        )

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected gateway error")
        return error_response(
            errors.InternalError("The server had an error processing the request."), request
        )

    app.add_exception_handler(errors.ServeAppError, on_app_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)
