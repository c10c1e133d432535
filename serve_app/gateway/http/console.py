"""The operator's console at ``/console``: keys, usage, SLA, replicas, batches and the audit log
as HTML.

Sign-in posts an admin key, checked by the admin API's own code (``access.identify_secret``,
``admin.require_admin``: a client key is refused, every attempt audited), and sets a signed,
expiring session cookie (``console_session``; HttpOnly, SameSite=Strict, Path=/console, Secure
over https). Each request re-reads the key from the store, so a revoked, expired or rotated key's
session ends at once. Each POST must carry the session's CSRF token and must not come from
another site. Every action goes through the admin API's code (``KeyOps`` inside ``admin.act_as``,
``admin.usage_report``), so the audit lines are the same. Routes are thin: check, call, render
(``console_pages``).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from pydantic import ValidationError
from starlette.responses import RedirectResponse, Response

from serve_app import errors
from serve_app.config import KeyRecord, format_validation_error
from serve_app.gateway.http import console_pages as pages
from serve_app.gateway.http.admin import NewKey, act_as, check_tier, require_admin, usage_report
from serve_app.gateway.http.console_replicas import replica_rows
from serve_app.gateway.http.console_session import (
    COOKIE,
    PATH,
    Session,
    Signer,
    cross_site,
    read_form,
    signer_for,
    to_signin,
)
from serve_app.gateway.http.console_sla import sla_rows
from serve_app.gateway.keys import access
from serve_app.gateway.keys.ops import KeyOps


class Ctx:
    """A signed-in request: its deps, signer, session and the admin key re-read from the store."""

    def __init__(self, request: Request, signer: Signer, session: Session, key: KeyRecord) -> None:
        self.request, self.signer, self.session, self.key = request, signer, session, key
        self.d = request.app.state.deps
        self.csrf = signer.csrf(session)

    async def ops(self, action: str, target: str | None, fn: Any) -> Any:
        """One key action as the admin API runs it (same audit line)."""
        return await act_as(self.d.audit, self.key, action, target, fn)


class Refused(Exception):
    """A console request turned away before its route runs: ``response`` is what it gets (the
    sign-in page, a 403 or the 503 without a secret). ``mount_console`` registers the handler."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


async def signed_in(request: Request) -> Ctx:
    """The request's session (a route's dependency), or ``Refused`` (sign-in page, 503)."""
    signer = await signer_for(request)
    if signer is None:
        raise Refused(pages.no_secret())
    session = signer.read(request.cookies.get(COOKIE))
    if session is None:
        raise Refused(to_signin())
    d = request.app.state.deps
    key = d.keys.by_id(session.key_id)
    if not signer.belongs(session, key):
        raise Refused(to_signin())
    assert key is not None
    return Ctx(request, signer, session, key)


async def posted(request: Request) -> tuple[Ctx, dict[str, str]]:
    """A state-changing POST (a route's dependency): same site, signed in, and carrying the
    session's CSRF token; else ``Refused``."""
    if cross_site(request.headers):
        raise Refused(pages.refused(403, "Cross-site request refused."))
    try:
        ctx = await signed_in(request)
    except Refused as exc:
        if exc.response.status_code == 303:
            raise Refused(pages.refused(403, "Not signed in.")) from None
        raise
    try:
        form = await read_form(request)
    except errors.ServeAppError as exc:
        raise Refused(pages.refused(exc.status, str(exc))) from None
    if not ctx.signer.csrf_ok(ctx.session, form.get("csrf")):
        raise Refused(pages.refused(403, "Missing or wrong CSRF token: reload the page and try again."))
    return ctx, form


SignedIn = Depends(signed_in)
Posted = Depends(posted)


def _new_key(form: dict[str, str], tiers: Any) -> NewKey:
    """The create form as the admin API's ``NewKey`` (its validation, its messages)."""
    doc: dict[str, Any] = {"id": form.get("id", "").strip(), "role": form.get("role") or "client"}
    for name in ("tier", "tenant", "expires_at"):
        if form.get(name, "").strip():
            doc[name] = form[name].strip()
    models = [m.strip() for m in form.get("models", "").split(",") if m.strip()]
    if models:
        doc["models"] = models
    if form.get("budget_tokens", "").strip():
        doc["budget"] = {"tokens": form["budget_tokens"].strip(),
                         "period": form.get("budget_period") or "month"}
    try:
        body = NewKey.model_validate(doc)
    except ValidationError as exc:
        raise errors.InvalidRequest(format_validation_error(exc)) from None
    check_tier(tiers, body.tier)
    return body


def build_console_router() -> APIRouter:
    router = APIRouter(prefix=PATH, include_in_schema=False)

    async def keys_page(ctx: Ctx, status: int = 200, **kw: Any) -> Response:
        records = await ctx.ops("key.list", None, lambda: KeyOps(ctx.d.keys).list())
        return pages.respond(pages.keys(records, ctx.d.cfg.tiers, ctx.csrf, ctx.key.id, **kw), status)

    @router.get("")
    async def home(ctx: Ctx = SignedIn) -> Response:
        return RedirectResponse("/console/keys", 303)

    @router.get("/signin")
    async def signin_form() -> Response:
        return pages.respond(pages.signin())

    @router.post("/signin")
    async def signin(request: Request) -> Response:
        if cross_site(request.headers):
            return pages.refused(403, "Cross-site request refused.")
        signer = await signer_for(request)
        if signer is None:
            return pages.no_secret()
        d = request.app.state.deps
        try:
            form = await read_form(request)
            secret = form.get("key", "").strip() or None
            key = await access.identify_secret(secret, d.keys, d.audit, "/console/signin")
            require_admin(key, d.audit, "/console/signin")
        except errors.ServeAppError as exc:
            status = exc.status if exc.status in (400, 413, 415) else 401
            msg = str(exc) if status != 401 else "Sign-in refused: an active admin key is needed."
            return pages.respond(pages.signin(msg), status)
        if d.audit is not None:
            d.audit.record("console.signin", actor=key.id, target=None, result="ok")
        resp = RedirectResponse("/console/keys", status_code=303, headers=pages.HEADERS)
        resp.set_cookie(COOKIE, signer.issue(key), max_age=signer.ttl_s, path=PATH, httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")
        return resp

    @router.post("/signout")
    async def signout(got: tuple[Ctx, dict[str, str]] = Posted) -> Response:
        ctx, _ = got
        if ctx.d.audit is not None:
            ctx.d.audit.record("console.signout", actor=ctx.key.id, target=None, result="ok")
        return to_signin()

    @router.get("/keys")
    async def keys(ctx: Ctx = SignedIn) -> Response:
        return await keys_page(ctx)

    @router.post("/keys")
    async def create(got: tuple[Ctx, dict[str, str]] = Posted) -> Response:
        ctx, form = got
        try:
            body = _new_key(form, ctx.d.cfg.tiers)
            fields = body.model_dump(exclude={"id"}, exclude_none=True)
            issued = await ctx.ops("key.create", body.id,
                                   lambda: KeyOps(ctx.d.keys).create(body.id, **fields))
        except errors.ServeAppError as exc:
            return await keys_page(ctx, exc.status, error=str(exc), form=form)
        return await keys_page(ctx, notice=f"Key {body.id} created.",
                               secret=(body.id, issued.secret))

    @router.post("/keys/{key_id}/{verb}")
    async def change(key_id: str, verb: str, got: tuple[Ctx, dict[str, str]] = Posted) -> Response:
        ctx, _ = got
        ops = KeyOps(ctx.d.keys)
        try:
            if verb == "rotate":
                issued = await ctx.ops("key.rotate", key_id, lambda: ops.rotate(key_id))
                return await keys_page(ctx, notice=f"Key {key_id} rotated: its old secret no "
                                       "longer works.", secret=(key_id, issued.secret))
            if verb == "revoke":
                await ctx.ops("key.revoke", key_id, lambda: ops.revoke(key_id))
                if key_id == ctx.key.id:
                    return to_signin()
                return await keys_page(ctx, notice=f"Key {key_id} revoked.")
        except errors.ServeAppError as exc:
            return await keys_page(ctx, exc.status, error=str(exc))
        return pages.refused(404, "Unknown action.")

    @router.get("/usage")
    async def usage(request: Request, ctx: Ctx = SignedIn) -> Response:
        q = {k: request.query_params.get(k, "").strip()[:128]
             for k in ("key_id", "tenant", "model", "period")}
        try:
            if q["period"] and not _is_period(q["period"]):
                raise errors.InvalidRequest(f"period ({q['period']!r}) must be YYYY-MM or YYYY-MM-DD")
            report = await usage_report(ctx.d, ctx.key, q["key_id"] or None, q["tenant"] or None,
                                        q["model"] or None, q["period"] or None)
        except errors.ServeAppError as exc:
            return pages.respond(pages.usage(None, q, ctx.csrf, ctx.key.id, str(exc)), exc.status)
        return pages.respond(pages.usage(report, q, ctx.csrf, ctx.key.id))

    @router.get("/sla")
    async def sla(ctx: Ctx = SignedIn) -> Response:
        rows, note = await sla_rows(ctx.d)
        return pages.respond(pages.sla(rows, note, ctx.csrf, ctx.key.id))

    @router.get("/replicas")
    async def replicas(ctx: Ctx = SignedIn) -> Response:
        rows, note = await replica_rows(ctx.d, ctx.d.replicas)
        return pages.respond(pages.replicas(rows, note, ctx.csrf, ctx.key.id))

    @router.get("/batches")
    async def batches(ctx: Ctx = SignedIn) -> Response:
        if ctx.d.batch is None:
            return pages.respond(pages.batches([], "The Batch API is off on this gateway.", ctx.csrf, ctx.key.id))
        docs = [vars(b) for b in await ctx.d.batch.store.recent(100)]
        return pages.respond(pages.batches(docs, None, ctx.csrf, ctx.key.id))

    @router.get("/audit")
    async def audit(ctx: Ctx = SignedIn) -> Response:
        if ctx.d.audit is None or ctx.d.audit.file is None:
            note = "No audit file: set gateway.state.dir (audit events are only counted now)."
            return pages.respond(pages.audit([], note, ctx.csrf, ctx.key.id))
        n = ctx.d.cfg.gateway.console.audit_lines
        lines = (await asyncio.to_thread(ctx.d.audit.lines))[-n:][::-1]
        return pages.respond(pages.audit(lines, f"The last {len(lines)} lines, newest first.",
                                 ctx.csrf, ctx.key.id))

    return router


def _is_period(value: str) -> bool:
    return re.fullmatch(r"\d{4}-\d{2}(-\d{2})?", value) is not None


def mount_console(app: FastAPI) -> None:
    """Add the console's routes to the gateway's app (``api.build_api``), unless it is off."""
    if app.state.deps.cfg.gateway.console.enabled:
        app.include_router(build_console_router())
        app.add_exception_handler(Refused, on_refused)


async def on_refused(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, Refused)
    return exc.response
