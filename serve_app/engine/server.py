"""The vLLM wrapper: one AsyncLLM plus vLLM's own OpenAI serving layer, with no Ray in sight.

Requests arrive as parsed JSON dicts and answer as a ``head`` followed by ``bytes``. Chat
templating, tools, logprobs, ``response_format``, ``n``, ``stop`` and ``stream_options`` are all
vLLM's; this module only adapts the calling convention, the errors and the stream framing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import hashlib
import importlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import TypeAdapter, ValidationError

from serve_app import errors
from serve_app.config import ModelConfig
from serve_app.engine.checks import check_request
from serve_app.engine.clients import EngineClient, TokenMeter, current_meter
from serve_app.engine.pacing import PacedEngineClient
from serve_app.engine.slots import GatedEngineClient, SlotGate
from serve_app.engine.watchdog import EngineWatchdog
from serve_app.protocol import (
    Endpoint,
    Head,
    RequestContext,
    Trailer,
    head,
    render_error,
    split_complete,
    stream_error,
    tokens_of,
    trailer,
    usage_tokens,
)

logger = logging.getLogger(__name__)

_END = object()


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


def _validation_error(err: ValidationError) -> errors.InvalidRequest:
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"] if not isinstance(p, int) or p >= 0]
    # Union request types prefix the location with the member's class name; drop it.
    while loc and loc[0][:1].isupper():
        loc.pop(0)
    param = loc[0] if loc else None
    msg = first["msg"].removeprefix("Value error, ")
    where = ".".join(loc)
    return errors.InvalidRequest(f"{where}: {msg}" if where else msg, param=param)


@cache
def request_adapter(request_type: str) -> TypeAdapter[Any]:
    """A validator for an endpoint's vLLM request type ("module:Name"; a class or a union)."""
    module, _, name = request_type.partition(":")
    return TypeAdapter(getattr(importlib.import_module(module), name))


def _usage_of(event: str) -> dict[str, Any] | None:
    try:
        usage = json.loads(event.removeprefix("data: "))["usage"]
        return usage if isinstance(usage, dict) else None
    except (ValueError, KeyError, TypeError):
        return None


def _error_item(exc: errors.ServeAppError, endpoint: Endpoint | None = None) -> Head:
    """An error answer, in the endpoint's dialect (Anthropic's envelope on the Messages API)."""
    status, body, _ = render_error(endpoint, exc)
    return head(status, json.dumps(body).encode())


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


# Set for the duration of one request: vLLM's Anthropic serving converts a Messages request into a
# chat request and drops its priority and request id on the way, so they are applied to the
# converted request (see ``EngineServer._apply_after_conversion``).
current_overrides: contextvars.ContextVar[Overrides | None] = contextvars.ContextVar(
    "current_overrides", default=None
)


def _sse(event: Any) -> str:
    """vLLM's Responses stream yields event objects; its own router frames them as SSE."""
    if isinstance(event, str):
        return event
    kind = getattr(event, "type", "unknown")
    return f"event: {kind}\ndata: {event.model_dump_json(indent=None, by_alias=True)}\n\n"


class EngineServer:
    """Owns one vLLM engine and the OpenAI serving objects built around it."""

    def __init__(self, cfg: ModelConfig, model_path: str, top_priority: int = 0) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.top_priority = top_priority  # the tier priority that may take reserved slots
        self.engine: Any = None
        self.gate: SlotGate | None = None
        self.state: Any = None  # vLLM's app state: its serving objects, by attribute name
        self.streamed_tokens = 0  # completion tokens the engine made for streamed requests
        self.watchdog: EngineWatchdog | None = None
        self.retry_after_s = 2

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        from starlette.datastructures import State
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.cli_args import FrontendArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.executor.abstract import Executor
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        t0 = time.monotonic()
        engine_args = AsyncEngineArgs(**self.cfg.engine_kwargs(self.model_path))
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        self.engine = AsyncLLM(
            vllm_config=vllm_config,
            executor_class=Executor.get_class(vllm_config),
            log_requests=False,
            log_stats=not engine_args.disable_log_stats,
            # vLLM's engine metrics through Ray's metrics agent (as ray_vllm_*), as Ray Serve LLM does.
            stat_loggers=[RayPrometheusStatLogger],
        )
        frontend = FrontendArgs(**self.cfg.frontend)
        args = argparse.Namespace(**(vars(frontend) | vars(engine_args)))
        self.state = State()
        tasks = await self.engine.get_supported_tasks()
        # vLLM's serving objects are built around the wrapped client (clients.py), so every
        # generate call they make goes through the slot gate and the pacing.
        client: Any = self._engine_client(vllm_config.scheduler_config.max_num_seqs)
        await init_app_state(client, self.state, args, supported_tasks=tasks)
        self._apply_after_conversion(getattr(self.state, "anthropic_serving_messages", None))
        self.max_model_len = vllm_config.model_config.max_model_len
        # vLLM reads its settings from os.environ on every access (several per streamed chunk);
        # its engine and worker processes cache them once started, and so does this replica.
        # (py-spy, c64: envs.__getattr__ and os.getenv took 4% of the replica's samples.)
        from vllm import envs

        envs.enable_envs_cache()
        self.watchdog = EngineWatchdog(self.engine, self.cfg.id)
        self.watchdog.start()
        logger.info(
            "Engine for %s ready in %.1f s (tasks %s, max_model_len %d)",
            self.cfg.id, time.monotonic() - t0, tasks, self.max_model_len,
        )

    @staticmethod
    def _apply_after_conversion(serving: Any) -> None:
        """Make vLLM's Anthropic serving apply the request's overrides to the chat request it
        converts each Messages request into (the conversion keeps neither priority nor id)."""
        if serving is None:
            return
        create = serving.create_chat_completion

        async def create_chat_completion(request: Any, raw_request: Any = None) -> Any:
            overrides = current_overrides.get()
            if overrides is not None:
                overrides.apply(request)
            return await create(request, raw_request)

        serving.create_chat_completion = create_chat_completion

    def _engine_client(self, max_num_seqs: int) -> EngineClient:
        """The chain vLLM's serving layer calls: pacing, then the slot gate, then the engine."""
        client: EngineClient = self.engine
        if self.cfg.admission.reserved_slots:
            self.gate = SlotGate(max_num_seqs, self.cfg.admission.reserved_slots, self.top_priority)
            client = GatedEngineClient(client, self.gate)
        # Streams read the engine at most once per interval, so vLLM merges tokens in between.
        return PacedEngineClient(client, self.cfg.stream_interval_ms / 1000.0)

    async def check_health(self) -> None:
        # Plain errors only: Ray Serve's controller keeps what a failed check raised, and vLLM's
        # EngineDeadError drags the engine's state along (see watchdog.py).
        if self.engine is None or self.watchdog is None:
            raise RuntimeError(f"engine of {self.cfg.id} not started")
        self.watchdog.check_health()

    def engine_dead(self) -> bool:
        return self.watchdog is not None and self.watchdog.dead

    def _dead_error(self) -> errors.ServiceUnavailable:
        return errors.ServiceUnavailable(
            f"model {self.cfg.id!r} lost its engine and is restarting; retry shortly",
            retry_after_s=self.retry_after_s,
        )

    def unfinished_requests(self) -> int:
        return int(self.engine.output_processor.get_num_unfinished_requests())

    def waiting_for_slot(self) -> int:
        """Requests held in this replica until an engine slot they may take is free."""
        return self.gate.waiting if self.gate is not None else 0

    def shutdown(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    # ---- requests ----------------------------------------------------------------------------
    async def handle(
        self, endpoint: Endpoint, body: dict[str, Any], ctx: RequestContext
    ) -> AsyncIterator[Head | bytes | tuple[bytes, int] | Trailer]:
        """Serve one request of ``endpoint``: a ``Head``, then for a stream chunks and a trailer."""
        if self.engine_dead():
            yield _error_item(self._dead_error(), endpoint)
            return
        serving = getattr(self.state, endpoint.serving, None)
        if serving is None:
            yield _error_item(errors.InvalidRequest(
                f"model {self.cfg.id!r} is a {self.cfg.task} model and does not serve "
                f"{endpoint.path}",
                param="model",
            ), endpoint)
            return
        meter = TokenMeter()
        token = current_meter.set(meter)
        overrides = self._overrides(ctx)
        set_overrides = current_overrides.set(overrides)
        try:
            check_request(body)
            request, wants_usage = self._prepare(endpoint, body, ctx)
            overrides.apply(request)
            call = getattr(serving, endpoint.handler)
            result = await asyncio.wait_for(call(request, raw_request=None), ctx.remaining_s(600.0))
        except ValidationError as exc:
            yield _error_item(_validation_error(exc), endpoint)
            return
        except errors.ServeAppError as exc:  # check_request's refusals
            yield _error_item(exc, endpoint)
            return
        except TimeoutError:
            yield _error_item(errors.GatewayTimeout(f"the {endpoint.name} request timed out"),
                              endpoint)
            return
        except Exception as exc:  # vLLM raises for bad input (too long, empty, ...)
            yield _error_item(self._map_exception(exc, endpoint.main_param), endpoint)
            return
        finally:
            current_meter.reset(token)
            current_overrides.reset(set_overrides)

        if isinstance(result, AsyncIterator):
            try:
                async for item in self._coalesce(result, wants_usage, meter, endpoint, overrides):
                    yield item
            finally:  # however the stream ended, even cancelled by a client that went away
                self.streamed_tokens += meter.completion_tokens
            return
        answer = self._complete(result, endpoint)
        for part in split_complete(answer["status"], answer["body"], answer["tokens"]):
            yield part

    # ---- internals ---------------------------------------------------------------------------
    def _complete(self, result: Any, endpoint: Endpoint) -> Head:
        """The head of a complete answer: vLLM's error, starlette response or response model."""
        error = getattr(result, "error", None)
        if error is not None and isinstance(getattr(error, "code", None), int):  # vLLM's ErrorResponse
            return _error_item(
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

    def _map_exception(self, exc: Exception, main_param: str = "messages") -> errors.ServeAppError:
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, EngineDeadError) or self.engine_dead():
            return self._dead_error()
        try:
            r = create_error_response(exc)
            return to_openai_error(int(r.error.code), r.error.message, r.error.param, main_param)
        except Exception:  # never let error mapping itself become a 500 with a traceback
            logger.exception("unmapped engine error for %s", self.cfg.id)
            return errors.InternalError("the engine failed to process the request")

    def _overrides(self, ctx: RequestContext) -> Overrides:
        """The gateway's decisions, as vLLM request fields: the tier's priority (only under the
        priority scheduler, which alone accepts one), the request id, the tenant's cache salt."""
        priority = ctx.priority if self.cfg.engine.scheduling_policy == "priority" else None
        salt = hashlib.sha256(ctx.tenant.encode()).hexdigest()[:32] if ctx.tenant else None
        return Overrides(priority, ctx.request_id, salt)

    def _prepare(self, endpoint: Endpoint, body: dict[str, Any], ctx: RequestContext) -> tuple[Any, bool]:
        """vLLM's request object, and whether the client asked for the stream's usage chunk.

        The gateway's priority, request id and cache salt are applied after validation, to the
        fields the request type has (``Overrides.apply``), so a client cannot set its own."""
        body = dict(body)
        body["model"] = self.cfg.id  # the gateway resolved aliases; vLLM knows only the id
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

    async def _coalesce(
        self, chunks: AsyncIterator[Any], wants_usage: bool = True, meter: TokenMeter | None = None,
        endpoint: Endpoint | None = None, overrides: Overrides | None = None,
    ) -> AsyncIterator[Head | tuple[bytes, int] | Trailer]:
        """Relay vLLM's SSE strings as few messages: whatever is ready goes out as one.

        The pacing happens upstream (``PacedEngineClient``): each engine output becomes a burst of
        SSE strings (role and first token; last token, usage and ``[DONE]``), and a burst travels
        as one message, with the completion tokens the engine has made so far (``meter``). The
        usage chunk is read for the trailer (and dropped if the client did not ask for it); a
        stream that ends without one (an error) reports the meter's count.

        A pump task drains vLLM's generator into a queue. If the consumer is cancelled (the client
        went away), the pump is cancelled too, which makes vLLM abort the request in the engine.
        """
        meter = meter if meter is not None else TokenMeter()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for chunk in chunks:
                    queue.put_nowait(_sse(chunk))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # surfaced to the client as an SSE error event
                logger.exception("stream failed for %s", self.cfg.id)
                queue.put_nowait(self._map_exception(exc))
            queue.put_nowait(_END)

        # vLLM's serving layer calls the engine client's generate as the pump reads it, so the
        # pump runs with this request's meter set (tasks vLLM starts from there inherit it).
        context = contextvars.copy_context()
        context.run(current_meter.set, meter)
        context.run(current_overrides.set, overrides)
        task = asyncio.create_task(pump(), context=context)
        first = True
        usage: dict[str, Any] | None = None
        try:
            while True:
                item = await queue.get()
                parts: list[bytes] = []
                done = False
                while True:
                    if item is _END:
                        done = True
                        break
                    if isinstance(item, errors.ServeAppError):
                        parts.append(stream_error(endpoint, item))
                        done = True
                        break
                    if '"usage":{' in item and '"choices":[]' in item:
                        usage = _usage_of(item)
                        if not wants_usage:
                            item = ""
                    if item:
                        parts.append(item.encode())
                    if queue.empty():
                        break
                    item = queue.get_nowait()
                data = b"".join(parts)
                if first:
                    yield head(200, data, stream=True, tokens=tokens_of(
                        meter.prompt_tokens, meter.completion_tokens))
                    first = False
                elif data:
                    yield data, meter.completion_tokens
                if done:
                    counted = usage_tokens(usage)
                    if counted is not None:
                        yield {"tokens": counted}
                    else:
                        yield trailer(meter.prompt_tokens, meter.completion_tokens)
                    return
        finally:
            if not task.done():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
