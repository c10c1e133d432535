"""LoRA adapters added and removed at run time: ``/admin/v1/adapters`` (issue 41).

``POST`` takes ``{name, model, source, tenant?}``. The name must be free (no model id, alias,
route, configured or run-time adapter has it), the base model must run vLLM with
``engine.enable_lora``, and the adapter must load: one replica of the base model loads it and
answers a one-token completion with it before anything is stored, so a missing folder, a rank
above ``max_lora_rank`` or a folder that is not an adapter is a 400 naming ``source``, and nothing
that serves is disturbed. Then the record goes to the state layer (``state.adapters``), where every
gateway replica reads it within ``routing.adapters.REFRESH_S``; each model replica loads it on its
first request for it. ``DELETE`` removes the record: new calls get the 404 of a model that does not
exist at once on this replica (within the refresh on the others), and the streams in flight on it
finish. Every action, refused or not, is one audit line (``adapter.create``, ``adapter.delete``,
``adapter.list``)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from serve_app import errors
from serve_app.config import BUILTIN_ADAPTERS, KeyRecord
from serve_app.config.model import _ID_RE, BUILTIN_PREFIX
from serve_app.gateway.routing.adapters import RuntimeAdapter
from serve_app.protocol import ENDPOINTS, RequestContext

T = TypeVar("T")
PROBE_TIMEOUT_S = 60.0  # a replica loads the adapter and makes one token


class NewAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=_ID_RE, description="The model name clients call it by.")
    model: str = Field(min_length=1, max_length=128, description="The base model's id.")
    source: str = Field(min_length=1, max_length=4096,
                        description="A PEFT adapter folder on the base model's nodes, or builtin:<name>.")
    tenant: str | None = Field(default=None, max_length=128,
                               description="Private to this tenant's keys; none: any key whose models name it.")


def _check(d: Any, body: NewAdapter) -> None:
    """What the gateway can refuse on its own: a taken name, a base model without LoRA, a builtin
    made for another model."""
    if d.router.taken(body.name) or (d.router.runtime is not None and d.router.runtime.get(body.name)):
        raise errors.Conflict(f"name ({body.name!r}) is already a model, alias, route or adapter",
                              param="name")
    model = next((m for m in d.cfg.models if m.id == body.model), None)
    if model is None:
        raise errors.InvalidRequest(f"model ({body.model!r}) is not a model of this app", param="model")
    if model.task != "generate" or not model.engine.enable_lora or model.synthetic or model.simulated:
        raise errors.InvalidRequest(f"model {body.model!r} serves no LoRA adapters: it needs a vLLM "
                                    "engine with engine.enable_lora true", param="model")
    base = BUILTIN_ADAPTERS.get(body.source.removeprefix(BUILTIN_PREFIX)) \
        if body.source.startswith(BUILTIN_PREFIX) else None
    if body.source.startswith(BUILTIN_PREFIX) and base != model.source:
        raise errors.InvalidRequest(f"source ({body.source!r}) is not a builtin adapter for "
                                    f"{body.model!r}", param="source")


async def _try_on_a_replica(d: Any, adapter: RuntimeAdapter, actor: KeyRecord) -> None:
    """One replica of the base model loads the adapter and makes one token with it."""
    ctx = RequestContext(request_id="adapter-check-" + uuid.uuid4().hex, key_id=actor.id,
                         tier=d.cfg.default_tier, deadline=time.time() + PROBE_TIMEOUT_S,
                         adapter={"name": adapter.name, "source": adapter.source, "check": "1"})
    body = {"model": adapter.name, "prompt": "ok", "max_tokens": 1, "temperature": 0}
    status, raw = await d.pipeline.forwarder.probe(adapter.model, ENDPOINTS["completions"], body, ctx,
                                                   PROBE_TIMEOUT_S)
    if status == 200:
        return
    try:
        message = str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = raw[:300].decode("utf-8", "replace")
    raise errors.for_status(status)(f"the adapter did not load: {message}", param="source")


def adapter_routes(router: APIRouter, admin_key: Callable[..., Awaitable[KeyRecord]],
                   read_model: Callable[..., Awaitable[Any]]) -> None:
    """Add the adapter routes to the admin API's ``router``."""

    async def audited(request: Request, actor: KeyRecord, action: str, target: str | None,
                      fn: Callable[[], Awaitable[T]]) -> T:
        audit = request.app.state.deps.audit
        try:
            out = await fn()
        except errors.ServeAppError as exc:
            if audit is not None:
                audit.record(action, actor=actor.id, target=target, result=exc.code or "error")
            raise
        if audit is not None:
            audit.record(action, actor=actor.id, target=target, result="ok")
        return out

    def table(request: Request) -> Any:
        runtime = request.app.state.deps.router.runtime
        if runtime is None:
            raise errors.ServiceUnavailable("run-time adapters are not available on this gateway")
        return runtime

    @router.post("/adapters", status_code=201)
    async def create_adapter(request: Request, actor: KeyRecord = Depends(admin_key)) -> dict[str, Any]:
        """Add a LoRA adapter to a base model: loaded and tried on one replica before it is stored."""
        body: NewAdapter = await read_model(request, NewAdapter)
        d = request.app.state.deps
        runtime = table(request)

        async def create() -> RuntimeAdapter:
            _check(d, body)
            adapter = RuntimeAdapter(name=body.name, model=body.model, source=body.source,
                                     tenant=body.tenant, created_at=int(time.time()), created_by=actor.id)
            await _try_on_a_replica(d, adapter, actor)
            if not await runtime.store.add(adapter.name, adapter.to_json()):
                raise errors.Conflict(f"name ({body.name!r}) is already an adapter", param="name")
            await runtime.refresh(force=True)
            return adapter

        return (await audited(request, actor, "adapter.create", body.name, create)).public()

    @router.get("/adapters")
    async def list_adapters(request: Request, actor: KeyRecord = Depends(admin_key)) -> dict[str, Any]:
        runtime = table(request)

        async def listed() -> list[RuntimeAdapter]:
            await runtime.refresh(force=True)
            return list(runtime.all())

        adapters = await audited(request, actor, "adapter.list", None, listed)
        return {"object": "list", "data": [a.public() for a in adapters]}

    @router.delete("/adapters/{name:path}")
    async def delete_adapter(name: str, request: Request,
                             actor: KeyRecord = Depends(admin_key)) -> dict[str, Any]:
        """Remove a run-time adapter: new calls get 404; the streams in flight on it finish."""
        runtime = table(request)

        async def delete() -> None:
            if not await runtime.store.delete(name):
                raise errors.NotFound(f"no run-time adapter named {name[:128]!r}")
            await runtime.refresh(force=True)

        await audited(request, actor, "adapter.delete", name[:128], delete)
        return {"object": "adapter.deleted", "name": name, "deleted": True}
