"""The vLLM wrapper: one AsyncLLM plus vLLM's own OpenAI serving layer, with no Ray in sight.

Requests arrive as parsed JSON dicts and answer as a ``head`` followed by ``bytes``. Chat
templating, tools, logprobs, ``response_format``, ``n``, ``stop`` and ``stream_options`` are all
vLLM's; this module only adapts the calling convention, the errors and the stream framing.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from serve_app import errors
from serve_app.config import ModelConfig
from serve_app.engine.pacing import PacedEngineClient
from serve_app.engine.slots import GatedEngineClient, SlotGate
from serve_app.protocol import SSE_DONE, RequestContext, head, sse_event, trailer

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


def _usage_of(event: str) -> dict[str, Any] | None:
    try:
        usage = json.loads(event.removeprefix("data: "))["usage"]
        return usage if isinstance(usage, dict) else None
    except (ValueError, KeyError, TypeError):
        return None


def _error_item(exc: errors.ServeAppError) -> dict[str, Any]:
    return head(exc.status, json.dumps(exc.to_body()).encode())


class EngineServer:
    """Owns one vLLM engine and the OpenAI serving objects built around it."""

    def __init__(self, cfg: ModelConfig, model_path: str, top_priority: int = 0) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.top_priority = top_priority  # the tier priority that may take reserved slots
        self.engine: Any = None
        self.gate: SlotGate | None = None
        self._chat: Any = None
        self._completion: Any = None
        self._embedding: Any = None

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.cli_args import FrontendArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger
        from starlette.datastructures import State

        t0 = time.monotonic()
        engine_args = AsyncEngineArgs(**self.cfg.engine_kwargs(self.model_path))
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        from vllm.v1.executor.abstract import Executor

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
        state = State()
        tasks = await self.engine.get_supported_tasks()
        await init_app_state(self.engine, state, args, supported_tasks=tasks)
        self._chat = getattr(state, "openai_serving_chat", None)
        self._completion = getattr(state, "openai_serving_completion", None)
        client: Any = self.engine
        if self.cfg.admission.reserved_slots:
            self.gate = SlotGate(vllm_config.scheduler_config.max_num_seqs,
                                 self.cfg.admission.reserved_slots, self.top_priority)
            client = GatedEngineClient(self.engine, self.gate)
        # Streams read the engine at most once per interval, so vLLM merges tokens in between.
        paced = PacedEngineClient(client, self.cfg.stream_interval_ms / 1000.0)
        for serving in (self._chat, self._completion):
            if serving is not None:
                serving.engine_client = paced
        self._embedding = getattr(state, "serving_embedding", None)
        self.max_model_len = vllm_config.model_config.max_model_len
        # vLLM reads its settings from os.environ on every access (several per streamed chunk);
        # its engine and worker processes cache them once started, and so does this replica.
        # (py-spy, c64: envs.__getattr__ and os.getenv took 4% of the replica's samples.)
        from vllm import envs

        envs.enable_envs_cache()
        logger.info(
            "Engine for %s ready in %.1f s (tasks %s, max_model_len %d)",
            self.cfg.id, time.monotonic() - t0, tasks, self.max_model_len,
        )

    async def check_health(self) -> None:
        if self.engine is None:
            raise RuntimeError("engine not started")
        await self.engine.check_health()

    def unfinished_requests(self) -> int:
        return int(self.engine.output_processor.get_num_unfinished_requests())

    def waiting_for_slot(self) -> int:
        """Requests held in this replica until an engine slot they may take is free."""
        return self.gate.waiting if self.gate is not None else 0

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    # ---- requests ----------------------------------------------------------------------------
    async def chat(self, body: dict[str, Any], ctx: RequestContext) -> AsyncIterator[Any]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        async for item in self._generate(
            self._chat, "create_chat_completion", ChatCompletionRequest, body, ctx, "messages"
        ):
            yield item

    async def completions(self, body: dict[str, Any], ctx: RequestContext) -> AsyncIterator[Any]:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        async for item in self._generate(
            self._completion, "create_completion", CompletionRequest, body, ctx, "prompt"
        ):
            yield item

    async def embeddings(self, body: dict[str, Any], ctx: RequestContext) -> AsyncIterator[Any]:
        from pydantic import TypeAdapter
        from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest

        if self._embedding is None:
            yield _error_item(self._wrong_task("embeddings"))
            return
        try:
            request = TypeAdapter(EmbeddingRequest).validate_python({**body, "model": self.cfg.id})
            response = await asyncio.wait_for(
                self._embedding(request, raw_request=None), ctx.remaining_s(600.0)
            )
        except ValidationError as exc:
            yield _error_item(_validation_error(exc))
            return
        except asyncio.TimeoutError:
            yield _error_item(errors.GatewayTimeout("the embedding request timed out"))
            return
        except Exception as exc:  # vLLM raises for bad input (too long, empty, ...)
            yield _error_item(self._map_exception(exc, "input"))
            return
        data = bytes(response.body)
        usage = json.loads(data).get("usage") if response.status_code == 200 else None
        yield head(response.status_code, data, usage=usage)

    # ---- internals ---------------------------------------------------------------------------
    def _wrong_task(self, endpoint: str) -> errors.InvalidRequest:
        return errors.InvalidRequest(
            f"model {self.cfg.id!r} is a {self.cfg.task} model and does not serve {endpoint}",
            param="model",
        )

    def _map_exception(self, exc: Exception, main_param: str = "messages") -> errors.ServeAppError:
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        try:
            r = create_error_response(exc)
            return to_openai_error(int(r.error.code), r.error.message, r.error.param, main_param)
        except Exception:  # never let error mapping itself become a 500 with a traceback
            logger.exception("unmapped engine error for %s", self.cfg.id)
            return errors.InternalError("the engine failed to process the request")

    def _prepare(self, request_cls: Any, body: dict[str, Any], ctx: RequestContext) -> tuple[Any, bool]:
        """vLLM's request object, and whether the client asked for the stream's usage chunk."""
        body = dict(body)
        body["model"] = self.cfg.id  # the gateway resolved aliases; vLLM knows only the id
        if self.cfg.engine.scheduling_policy == "priority":
            body["priority"] = ctx.priority
        if ctx.tenant:
            body["cache_salt"] = hashlib.sha256(ctx.tenant.encode()).hexdigest()[:32]
        wants_usage = True
        if body.get("stream") is True:
            opts = body.get("stream_options")
            opts = dict(opts) if isinstance(opts, dict) else {}
            wants_usage = bool(opts.get("include_usage"))
            # Always ask vLLM for the usage chunk: the gateway accounts tokens from it.
            opts["include_usage"] = True
            body["stream_options"] = opts
        request = request_cls.model_validate(body)
        request.request_id = ctx.request_id
        return request, wants_usage

    async def _generate(
        self,
        serving: Any,
        method: str,
        request_cls: Any,
        body: dict[str, Any],
        ctx: RequestContext,
        main_param: str,
    ) -> AsyncIterator[Any]:
        if serving is None:
            yield _error_item(self._wrong_task("chat or text completions"))
            return
        try:
            request, wants_usage = self._prepare(request_cls, body, ctx)
            result = await getattr(serving, method)(request, raw_request=None)
        except ValidationError as exc:
            yield _error_item(_validation_error(exc))
            return
        except Exception as exc:
            yield _error_item(self._map_exception(exc, main_param))
            return

        if isinstance(result, AsyncIterator):
            async for item in self._coalesce(result, wants_usage):
                yield item
            return
        error = getattr(result, "error", None)
        if error is not None:
            yield _error_item(
                to_openai_error(int(error.code), error.message, error.param, main_param)
            )
            return
        usage = result.usage.model_dump() if getattr(result, "usage", None) else None
        yield head(200, result.model_dump_json(exclude_unset=False).encode(), usage=usage)

    async def _coalesce(self, chunks: AsyncIterator[str], wants_usage: bool = True) -> AsyncIterator[Any]:
        """Relay vLLM's SSE strings as few messages: whatever is ready goes out as one.

        The pacing happens upstream (``PacedEngineClient``): each engine output becomes a burst of
        SSE strings (role and first token; last token, usage and ``[DONE]``), and a burst travels
        as one message. The usage chunk is read for the trailer (and dropped if the client did not
        ask for it).

        A pump task drains vLLM's generator into a queue. If the consumer is cancelled (the client
        went away), the pump is cancelled too, which makes vLLM abort the request in the engine.
        """
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for chunk in chunks:
                    queue.put_nowait(chunk)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # surfaced to the client as an SSE error event
                logger.exception("stream failed for %s", self.cfg.id)
                queue.put_nowait(self._map_exception(exc))
            queue.put_nowait(_END)

        task = asyncio.create_task(pump())
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
                        parts.append(sse_event(json.dumps(item.to_body()).encode()))
                        parts.append(SSE_DONE)
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
                    yield head(200, data, stream=True)
                    first = False
                elif data:
                    yield data
                if done:
                    yield trailer(usage)
                    return
        finally:
            if not task.done():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass

