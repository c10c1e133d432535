"""The admin API under ``/admin/v1``: keys (create, list, get, update, rotate, revoke), usage, and
LoRA adapters added at run time (``admin_adapters``).

Only keys with ``role: admin`` are accepted here (a client key gets 403, an unknown one 401), and
an admin key is refused on the model routes (``api.authenticate``), so a leaked client key cannot
mint keys and an admin key cannot run up usage. A created or rotated key's secret is in that one
answer and stored only as a digest. Every action, allowed or not, is one audit line
(``audit.py``). Errors are OpenAI-shaped (the app's one handler); the schema of these routes is
at ``GET /admin/v1/openapi.json``.

The admin routes are served on the gateway's own port; to keep them off the public network, route
only ``/v1`` and ``/health`` to the gateway from the public side (an ingress or load-balancer path
rule) and reach ``/admin/v1`` from inside.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serve_app import errors
from serve_app.bodies import parse_body
from serve_app.config import Budget, KeyRecord, Limits
from serve_app.gateway.accounting.audit import Audit
from serve_app.gateway.http.admin_adapters import NewAdapter, adapter_routes
from serve_app.gateway.http.read import read_capped, require_json
from serve_app.gateway.keys import access
from serve_app.gateway.keys.ops import KeyOps, describe
from serve_app.state.keys import (
    KeyConflict,
    KeyInvalid,
    KeyNotFound,
    KeysFileError,
    StoreReadOnly,
)

logger = logging.getLogger("ray.serve")
PREFIX = "/admin/v1"
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
# An admin body is a few hundred bytes; nothing above this is read (and only after the key has
# been checked: FastAPI would read and parse a body parameter before any dependency ran).
ADMIN_BODY_LIMIT = 64 * 1024


class KeyFields(BaseModel):
    """The fields of a key that the admin API sets (any subset on an update; null clears)."""

    model_config = ConfigDict(extra="forbid")

    tier: str | None = None
    models: list[str] | None = None
    tenant: str | None = None
    limits: Limits | None = None
    budget: Budget | None = None
    expires_at: str | None = Field(default=None, description="ISO 8601; UTC when no offset")


class NewKey(KeyFields):
    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    role: Literal["client", "admin"] = "client"


def _deps(request: Request) -> Any:
    return request.app.state.deps


async def read_model(request: Request, model: type[M]) -> M:
    """The request's JSON body as ``model``, read only after the route's key check (a route's
    dependencies run first) and never past ``ADMIN_BODY_LIMIT`` (413); a body that is not JSON,
    or does not fit ``model``, is a 400 naming the field."""
    require_json(request)
    raw = await read_capped(request, ADMIN_BODY_LIMIT)
    try:
        return model.model_validate(parse_body(raw))
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


def _body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads ``model`` itself (``read_model``)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


async def admin_key(request: Request) -> KeyRecord:
    """The admin key of the request: 401 without a valid key, 403 with a client key."""
    d = _deps(request)
    key = await access.identify(request, d.keys, d.audit)
    return require_admin(key, d.audit, access.route_of(request))


def require_admin(key: KeyRecord, audit: Audit | None, route: str) -> KeyRecord:
    """``key`` if its role is admin, else 403 (audited as ``admin_denied``); the admin API and
    the console's sign-in both check here."""
    if key.role != "admin":
        if audit is not None:
            audit.record("admin_denied", actor=key.id, target=None, result="forbidden", route=route)
        raise errors.PermissionDenied("This key may not use the admin API; an admin key is needed.")
    return key


def _fail(exc: KeysFileError) -> errors.ServeAppError:
    """A store error as the HTTP error an operator can act on."""
    if isinstance(exc, KeyNotFound):
        return errors.NotFound(str(exc))
    if isinstance(exc, KeyConflict):
        return errors.Conflict(str(exc))
    if isinstance(exc, StoreReadOnly):
        return errors.PermissionDenied(str(exc), code="read_only_store")
    if isinstance(exc, KeyInvalid):
        return errors.InvalidRequest(str(exc))
    # The store itself cannot be read (its message may name a server path): said in the log only.
    logger.error("key store error: %s", exc)
    return errors.InternalError("The key store could not be read; see the gateway's log.")


def _check_tier(request: Request, tier: str | None) -> None:
    check_tier(_deps(request).cfg.tiers, tier)


def check_tier(tiers: Mapping[str, object], tier: str | None) -> None:
    """A key's tier must be one of the config's (a 400 naming the field otherwise)."""
    if tier is not None and tier not in tiers:
        raise errors.InvalidRequest(f"tier ({tier!r}) is not one of {sorted(tiers)}", param="tier")


async def act_as(audit: Audit | None, actor: KeyRecord, action: str, target: str | None,
                 fn: Callable[[], Awaitable[T]]) -> T:
    """Run one admin action and audit it, whatever its result (the admin API and the console)."""
    try:
        out = await fn()
    except KeysFileError as exc:
        err = _fail(exc)
        if audit is not None:
            audit.record(action, actor=actor.id, target=target, result=err.code or "error")
        raise err from None
    if audit is not None:
        audit.record(action, actor=actor.id, target=target, result="ok")
    return out


async def usage_report(d: Any, actor: KeyRecord, key_id: str | None, tenant: str | None,
                       model: str | None, period: str | None) -> dict[str, Any]:
    """Requests and tokens by key (``GET /admin/v1/usage`` and the console's usage page), audited
    as ``usage.read``."""
    keys = await act_as(d.audit, actor, "usage.read", key_id, lambda: KeyOps(d.keys).list())
    by_key = {}
    for k in keys:
        if (key_id and k.id != key_id) or (tenant and k.tenant_id != tenant):
            continue
        by_key[k.id] = _pick(await d.usage.store.get(k.id), model, period)
    if key_id and not by_key:
        raise errors.NotFound(f"no key with id {key_id!r}")
    total = {f: sum(v[f] for v in by_key.values()) for f in _FIELDS}
    return {"object": "usage", "key_id": key_id, "tenant": tenant, "model": model,
            "period": period, **total, "by_key": by_key}


def build_admin_router() -> APIRouter:
    router = APIRouter(prefix=PREFIX, tags=["admin"])

    async def act(request: Request, actor: KeyRecord, action: str, target: str | None,
                  fn: Callable[[], Awaitable[T]]) -> T:
        return await act_as(_deps(request).audit, actor, action, target, fn)

    def ops(request: Request) -> KeyOps:
        return KeyOps(_deps(request).keys)

    @router.post("/keys", status_code=201, openapi_extra=_body_doc(NewKey))
    async def create_key(request: Request,
                         actor: KeyRecord = Depends(admin_key)) -> dict[str, Any]:
        """Create a key; its secret is in this answer only."""
        body = await read_model(request, NewKey)
        _check_tier(request, body.tier)
        fields = body.model_dump(exclude={"id"}, exclude_none=True)
        issued = await act(request, actor, "key.create", body.id,
                     lambda: ops(request).create(body.id, **fields))
        return {**describe(issued.record), "secret": issued.secret}

    @router.get("/keys")
    async def list_keys(request: Request,
                        actor: KeyRecord = Depends(admin_key)) -> dict[str, Any]:
        keys = await act(request, actor, "key.list", None, lambda: ops(request).list())
        return {"object": "list", "data": [describe(k) for k in keys]}

    @router.get("/keys/{key_id}")
    async def get_key(key_id: str, request: Request,
                      actor: KeyRecord = Depends(admin_key)) -> dict[str, Any]:
        key = await act(request, actor, "key.get", key_id, lambda: ops(request).get(key_id))
        d = _deps(request)
        out = describe(key)
        if d.budgets is not None:
            out["budget_status"] = await d.budgets.status(key)
        return out

    @router.patch("/keys/{key_id}", openapi_extra=_body_doc(KeyFields))
    async def update_key(key_id: str, request: Request,
                         actor: KeyRecord = Depends(admin_key)) -> dict[str, Any]:
        """Change limits, tier, models, tenant, budget or expiry; the key keeps its secret."""
        body = await read_model(request, KeyFields)
        _check_tier(request, body.tier)
        changes = body.model_dump(exclude_unset=True, mode="json")
        if "models" in changes and changes["models"] is None:
            changes["models"] = ["*"]
        record = await act(request, actor, "key.update", key_id,
                     lambda: ops(request).update(key_id, changes))
        return describe(record)

    @router.post("/keys/{key_id}/rotate")
    async def rotate_key(key_id: str, request: Request,
                         actor: KeyRecord = Depends(admin_key)) -> dict[str, Any]:
        """A new secret (in this answer only); the old one stops within seconds."""
        issued = await act(request, actor, "key.rotate", key_id, lambda: ops(request).rotate(key_id))
        return {**describe(issued.record), "secret": issued.secret}

    @router.delete("/keys/{key_id}")
    async def revoke_key(key_id: str, request: Request,
                         actor: KeyRecord = Depends(admin_key)) -> dict[str, Any]:
        """Revoke a key: every replica answers it 401 within seconds. The record stays listed."""
        record = await act(request, actor, "key.revoke", key_id, lambda: ops(request).revoke(key_id))
        return describe(record)

    @router.get("/usage")
    async def usage(
        request: Request,
        key_id: str | None = Query(None, max_length=64),
        tenant: str | None = Query(None, max_length=128),
        model: str | None = Query(None, max_length=128),
        period: str | None = Query(None, pattern=r"^\d{4}-\d{2}(-\d{2})?$",
                                   description="A UTC day (YYYY-MM-DD) or month (YYYY-MM)"),
        actor: KeyRecord = Depends(admin_key),
    ) -> dict[str, Any]:
        """Requests and tokens by key, for the keys matching ``key_id`` and ``tenant``, counted
        for one ``model`` and/or one ``period`` when given."""
        return await usage_report(_deps(request), actor, key_id, tenant, model, period)

    adapter_routes(router, admin_key, read_model)

    @router.get("/openapi.json", include_in_schema=False)
    async def schema(request: Request, actor: KeyRecord = Depends(admin_key)) -> dict[str, Any]:
        doc = get_openapi(title="serve-app admin API", version="1", routes=router.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in (NewKey, KeyFields, NewAdapter):  # the bodies read by ``read_model``
            shape = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(shape.pop("$defs", {}))
            schemas[model.__name__] = shape
        return doc

    return router


_FIELDS = ("requests", "prompt_tokens", "completion_tokens")


def _pick(totals: dict[str, int], model: str | None, period: str | None) -> dict[str, int]:
    """The three counts of one key: all time, or for one model (``m:``) or period (``d:``).
    Model and period together cannot be split from per-key totals; the model wins then."""
    if model:
        return {f: totals.get(f"m:{model}:{f}", 0) for f in _FIELDS}
    if period:
        return {f: sum(v for k, v in totals.items()
                       if k.startswith(f"d:{period}") and k.endswith(f":{f}")) for f in _FIELDS}
    return {f: totals.get(f, 0) for f in _FIELDS}


def mount_admin(app: FastAPI) -> None:
    """Add the admin routes to the gateway's app (``api.build_api``)."""
    app.include_router(build_admin_router())
