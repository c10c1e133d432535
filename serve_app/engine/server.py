"""The vLLM backend: one AsyncLLM plus vLLM's own OpenAI serving layer, with no Ray in sight.

``EngineServer`` implements ``backend.Backend``. It owns the engine's lifecycle and dispatches each
request to vLLM's serving object for its endpoint; the pieces have modules of their own:

- ``startup.py``: the AsyncLLM, the client chain (``clients.py``) and vLLM's serving objects;
- ``adapter.py``: the gateway's body and decisions as vLLM's request, vLLM's answers and errors
  as a ``Head``;
- ``coalesce.py``: a vLLM stream as a ``Head``, ``Chunk`` tuples and a ``Trailer``;
- ``watchdog.py``: engine death, answered 503 at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from serve_app import errors
from serve_app.config import ModelConfig
from serve_app.engine import startup
from serve_app.engine.adapter import (
    RequestAdapter,
    RequestScope,
    complete_head,
    error_head,
    handler_for,
    to_openai_error,
    validation_error,
)
from serve_app.engine.backend import Answer, Diagnostics
from serve_app.engine.checks import check_prepared, check_request
from serve_app.engine.coalesce import Coalescer
from serve_app.engine.loras import RuntimeLoras
from serve_app.engine.slots import SlotGate
from serve_app.engine.watchdog import EngineWatchdog
from serve_app.protocol import Endpoint, RequestContext, split_complete

logger = logging.getLogger(__name__)


class EngineServer:
    """Owns one vLLM engine and the OpenAI serving objects built around it (a ``Backend``)."""

    def __init__(self, cfg: ModelConfig, model_path: str, top_priority: int = 0,
                 adapter_paths: dict[str, str] | None = None, cache_dir: str = "") -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.adapter_paths = adapter_paths or {}  # LoRA adapters' names and resolved folders
        self.cache_dir = cache_dir  # where builtin adapters added at run time are built
        self.loras: RuntimeLoras | None = None  # adapters added at run time (engine.enable_lora)
        self.top_priority = top_priority  # the tier priority that may take reserved slots
        self.adapter = RequestAdapter(cfg)
        self.engine: Any = None
        self.gate: SlotGate | None = None
        self.state: Any = None  # vLLM's app state: its serving objects, by attribute name
        self.streamed_tokens = 0  # completion tokens the engine made for streamed requests
        self.watchdog: EngineWatchdog | None = None
        self.retry_after_s = 2

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        t0 = time.monotonic()
        # Kept on self at once: a start-up that times out after this still shuts the engine down.
        self.engine, vllm_config, args = startup.new_engine(
            self.cfg, self.model_path, self.adapter_paths)
        client, self.gate = startup.client_chain(
            self.engine, self.cfg, vllm_config.scheduler_config.max_num_seqs, self.top_priority)
        self.state, tasks = await startup.serving_objects(self.engine, client, args)
        if self.cfg.engine.enable_lora:
            from serve_app.metrics import AdapterMetrics

            self.loras = RuntimeLoras(self.cfg, self.cache_dir, self.state.openai_serving_models,
                                      self.engine, AdapterMetrics.for_this_replica())
        max_model_len = vllm_config.model_config.max_model_len
        startup.cache_vllm_envs()
        self.watchdog = EngineWatchdog(self.engine, self.cfg.id)
        self.watchdog.start()
        logger.info(
            "Engine for %s ready in %.1f s (tasks %s, max_model_len %d)",
            self.cfg.id, time.monotonic() - t0, tasks, max_model_len,
        )

    async def check_health(self) -> None:
        # Plain errors only: Ray Serve's controller keeps what a failed check raised, and vLLM's
        # EngineDeadError drags the engine's state along (see watchdog.py).
        if self.engine is None or self.watchdog is None:
            raise RuntimeError(f"engine of {self.cfg.id} not started")
        self.watchdog.check_health()

    def engine_dead(self) -> bool:
        return self.watchdog is not None and self.watchdog.dead

    def diagnostics(self) -> Diagnostics:
        return {
            "unfinished_requests": int(self.engine.output_processor.get_num_unfinished_requests()),
            "waiting_for_slot": self.gate.waiting if self.gate is not None else 0,
            "streamed_tokens": self.streamed_tokens,
            "engine_dead": self.engine_dead(),
        }

    def shutdown(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    # ---- requests ----------------------------------------------------------------------------
    async def handle(self, endpoint: Endpoint, body: dict[str, Any], ctx: RequestContext) -> AsyncIterator[Answer]:
        """Serve one request of ``endpoint``: a ``Head``, then for a stream chunks and a trailer."""
        if self.engine_dead():
            yield error_head(self._dead_error(), endpoint)
            return
        serving = getattr(self.state, endpoint.serving, None)
        if serving is None:
            yield error_head(errors.InvalidRequest(
                f"model {self.cfg.id!r} is a {self.cfg.task} model and does not serve "
                f"{endpoint.path}",
                param="model",
            ), endpoint)
            return
        adapter = ctx.adapter["name"] if ctx.adapter is not None else None
        if ctx.adapter is not None:
            refused = await self._load_adapter(ctx.adapter)
            if refused is not None:
                yield error_head(refused, endpoint)
                return
        if adapter is not None and self.loras is not None:
            self.loras.in_use[adapter] += 1  # an adapter is replaced only once no request uses it
        try:
            scope = RequestScope.open()
            try:
                check_request(body)
                request, wants_usage = self.adapter.prepare(endpoint, body, runtime_adapter=adapter)
                check_prepared(request, lora=self.cfg.engine.enable_lora)
                overrides = self.adapter.overrides(ctx)
                overrides.apply(request)
                call = handler_for(serving, endpoint.handler, overrides)
                # Run in the request's context (its meter set), as a task as wait_for would make anyway.
                task = asyncio.create_task(call(request, raw_request=None), context=scope.context)
                result = await asyncio.wait_for(task, ctx.remaining_s(600.0))
            except ValidationError as exc:
                yield error_head(validation_error(exc), endpoint)
                return
            except errors.ServeAppError as exc:  # check_request's refusals
                yield error_head(exc, endpoint)
                return
            except TimeoutError:
                yield error_head(errors.GatewayTimeout(f"the {endpoint.name} request timed out"),
                                 endpoint)
                return
            except Exception as exc:  # vLLM raises for bad input (too long, empty, ...)
                yield error_head(self._map_exception(exc, endpoint.main_param), endpoint)
                return

            if isinstance(result, AsyncIterator):
                coalescer = Coalescer(scope.meter, self._map_exception, wants_usage=wants_usage,
                                      endpoint=endpoint, model=self.cfg.id)
                try:
                    async for item in coalescer.relay(result, scope.context):
                        yield item
                finally:  # however the stream ended, even cancelled by a client that went away
                    self.streamed_tokens += scope.meter.completion_tokens
                return
            answer = complete_head(result, endpoint)
            for part in split_complete(answer["status"], answer["body"], answer["tokens"]):
                yield part
        finally:
            if adapter is not None and self.loras is not None:
                self.loras.in_use[adapter] -= 1

    async def _load_adapter(self, adapter: dict[str, str]) -> errors.ServeAppError | None:
        """Load a run-time adapter unless loaded (``loras.RuntimeLoras``); the refusal, if any.
        The admin API's check (``adapter["check"]``) gets the reason; a client gets a 503 that
        names no folder (the reason goes to this replica's log)."""
        if self.loras is None:
            return errors.InvalidRequest(f"model {self.cfg.id!r} serves no LoRA adapters "
                                         "(engine.enable_lora)", param="model")
        try:
            await self.loras.ensure(adapter["name"], adapter["source"])
        except errors.ServeAppError as exc:
            if adapter.get("check"):
                return exc
            logger.warning("run-time adapter %s not loaded: %s", adapter["name"], exc)
            return errors.ServiceUnavailable(
                f"adapter {adapter['name']!r} could not be loaded on this replica; retry shortly, "
                "or ask the operator (the replica's log says why)", retry_after_s=self.retry_after_s)
        return None

    def _dead_error(self) -> errors.ServiceUnavailable:
        return errors.ServiceUnavailable(
            f"model {self.cfg.id!r} lost its engine and is restarting; retry shortly",
            retry_after_s=self.retry_after_s,
        )

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
