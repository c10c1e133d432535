"""Per-request adaptation between the gateway's calling convention and vLLM's serving objects.

Down: the gateway's parsed body becomes vLLM's request object (``RequestAdapter.prepare``), and the
gateway's decisions (``RequestContext``: tier priority, request id, tenant) become vLLM request
fields (``Overrides``). Up: vLLM's complete answers and errors become a ``Head`` in the endpoint's
dialect (``complete_head``, ``to_openai_error``). Streams are ``coalesce.py``'s.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import TypeAdapter, ValidationError

from serve_app import errors
from serve_app.config import ModelConfig
from serve_app.engine.clients import TokenMeter, current_meter
from serve_app.protocol import Endpoint, Head, RequestContext, head, render_error, usage_tokens


def to_openai_error(
    status: int, message: str, param: str | None, main_param: str = "messages"
) -> errors.ServeAppError:
    """Map a vLLM error (status + message) onto our hierarchy, naming the context-length case.

    vLLM names its internal parameter (``input_tokens``) for a too-long prompt; OpenAI names the
    request field, so the endpoint's main input field (``messages``, ``prompt``, ``input``) is used.
    """
    if status == 400 and "maximum context length" in message:
        return errors.ContextLengthExceeded(message, param=main_param)
    return errors.for_status(status)(message, param=param)


def validation_error(err: ValidationError) -> errors.InvalidRequest:
    """A body that vLLM's request type refused, as a 400 that names the first bad field."""
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"] if not isinstance(p, int) or p >= 0]
    # Union request types prefix the location with the member's class name; drop it.
    while loc and loc[0][:1].isupper():
        loc.pop(0)
    param = loc[0] if loc else None
    msg = first["msg"].removeprefix("Value error, ")
    where = ".".join(loc)
    return errors.InvalidRequest(f"{where}: {msg}" if where else msg, param=param)


def error_head(exc: errors.ServeAppError, endpoint: Endpoint | None = None) -> Head:
    """An error answer, in the endpoint's dialect (Anthropic's envelope on the Messages API)."""
    status, body, _ = render_error(endpoint, exc)
    return head(status, json.dumps(body).encode())


@cache
def request_adapter(request_type: str) -> TypeAdapter[Any]:
    """A validator for an endpoint's vLLM request type ("module:Name"; a class or a union)."""
    module, _, name = request_type.partition(":")
    return TypeAdapter(getattr(importlib.import_module(module), name))


def cache_salt(tenant: str) -> str | None:
    """vLLM's ``cache_salt`` for a tenant (None for none): keys of one tenant share the prefix
    cache, and no other tenant's request can hit, and so time, their blocks."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:32] if tenant else None


@dataclass(frozen=True)
class Overrides:
    """What the gateway decided for a request, applied to the request vLLM finally schedules."""

    priority: int | None
    request_id: str
    cache_salt: str | None

    def apply(self, request: Any) -> None:
        if self.priority is not None and hasattr(request, "priority"):
            request.priority = self.priority
        if hasattr(request, "request_id"):
            request.request_id = self.request_id
        if self.cache_salt is not None and hasattr(request, "cache_salt"):
            request.cache_salt = self.cache_salt


class _OverridesAfterConversion:
    """One request's view of a vLLM serving object that converts its request into a chat request
    before scheduling it (the Anthropic Messages serving): the conversion keeps neither priority
    nor request id nor cache salt, so they are applied to the converted request.

    vLLM offers no parameter for this: ``create_messages`` converts, then calls
    ``self.create_chat_completion``. So its handler runs with this view as ``self``
    (``handler_for``): that one call comes here, every other attribute is the serving object's.
    vLLM's object itself is left untouched, and the overrides travel with the call.
    """

    def __init__(self, serving: Any, overrides: Overrides) -> None:
        self._serving = serving
        self._overrides = overrides

    def __getattr__(self, name: str) -> Any:
        return getattr(self._serving, name)

    async def create_chat_completion(self, request: Any, raw_request: Any = None) -> Any:
        self._overrides.apply(request)
        return await self._serving.create_chat_completion(request, raw_request)


def handler_for(serving: Any, name: str, overrides: Overrides) -> Callable[..., Any]:
    """The method ``name`` of vLLM's ``serving`` object to call for one request, bound so that a
    request it converts into a chat request (``to_chat_completion_request``) gets ``overrides``."""
    if hasattr(serving, "to_chat_completion_request"):
        return functools.partial(getattr(type(serving), name), _OverridesAfterConversion(serving, overrides))
    return getattr(serving, name)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class RequestScope:
    """The ``contextvars.Context`` that vLLM's code runs in for one request, with its meter set.

    vLLM's serving layer calls the shared engine client chain (``clients.py``) with no per-request
    argument of ours, so the request's ``TokenMeter`` reaches the paced client as a context
    variable. It is set once, in a context of its own, and both phases of the request run in it:
    the serving call (which calls ``generate`` for a complete answer) and the pump that reads a
    stream (vLLM's generator calls ``generate`` only as it is read). Tasks vLLM starts from there
    copy the context, so they see the meter too.
    """

    meter: TokenMeter
    context: contextvars.Context

    @classmethod
    def open(cls) -> RequestScope:
        meter = TokenMeter()
        context = contextvars.copy_context()
        context.run(current_meter.set, meter)
        return cls(meter, context)


class RequestAdapter:
    """Turns one model's requests into vLLM's request objects, with the gateway's decisions."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.adapter_names = frozenset(a.name for a in cfg.adapters)

    def overrides(self, ctx: RequestContext) -> Overrides:
        """The gateway's decisions, as vLLM request fields: the tier's priority (only under the
        priority scheduler, which alone accepts one), the request id, the tenant's cache salt."""
        priority = ctx.priority if self.cfg.engine.scheduling_policy == "priority" else None
        return Overrides(priority, ctx.request_id, cache_salt(ctx.tenant))

    def prepare(self, endpoint: Endpoint, body: dict[str, Any],
                runtime_adapter: str | None = None) -> tuple[Any, bool]:
        """vLLM's request object, and whether the client asked for the stream's usage chunk.
        ``runtime_adapter``: the run-time adapter the request names, loaded in this engine.

        The gateway's priority, request id and cache salt are applied after validation, to the
        fields the request type has (``Overrides.apply``), so a client cannot set its own."""
        body = dict(body)
        # The gateway resolved aliases and routes; vLLM knows only the id and the adapters' names
        # (an adapter's name makes vLLM's serving layer apply it: its LoRARequest), configured or
        # added at run time.
        if body.get("model") not in self.adapter_names and body.get("model") != runtime_adapter:
            body["model"] = self.cfg.id
        wants_usage = True
        if endpoint.stream_options:
            if body.get("stream") is True:
                opts = body.get("stream_options")
                opts = dict(opts) if isinstance(opts, dict) else {}
                wants_usage = bool(opts.get("include_usage"))
                # Always ask vLLM for the usage chunk: the gateway accounts tokens from it.
                opts["include_usage"] = True
                body["stream_options"] = opts
        request = request_adapter(endpoint.request_type).validate_python(body)
        return request, wants_usage


def complete_head(result: Any, endpoint: Endpoint) -> Head:
    """The head of a complete answer: vLLM's error, starlette response or response model."""
    error = getattr(result, "error", None)
    if error is not None and isinstance(getattr(error, "code", None), int):  # vLLM's ErrorResponse
        return error_head(
            to_openai_error(int(error.code), error.message, error.param, endpoint.main_param),
            endpoint,
        )
    if hasattr(result, "status_code"):  # a starlette Response (the pooling endpoints)
        data = bytes(result.body)
        ok = result.status_code == 200
        return head(result.status_code, data,
                    tokens=usage_tokens(json.loads(data).get("usage")) if ok else None)
    usage = result.usage.model_dump() if getattr(result, "usage", None) else None
    # As vLLM's own routers dump them: Anthropic's without nulls, the Responses API's by alias.
    dump = dict.fromkeys(endpoint.dump_flags, True)
    return head(200, result.model_dump_json(**dump).encode(), tokens=usage_tokens(usage))
