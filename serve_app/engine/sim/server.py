"""The simulated engine as a ``backend.Backend``: what a model replica serves when its config has
``simulated``.

Requests go through ``engine.SimEngine`` (vLLM's scheduler in modelled time) and come back as the
same ``Head``, chunks and ``Trailer`` as from ``server.EngineServer``, so the gateway, its routers,
admission, flow queue and autoscaling cannot tell a simulated fleet from a real one. The token
counts are exact (the prompt's made-up ids, the tokens made), a prefix hit shows as
``usage.prompt_tokens_details.cached_tokens``, and every answer says it is simulated: its ``id``
starts with ``sim-``, ``system_fingerprint`` is ``serve-app-simulated``, its text is the word
``simulated`` repeated, and the replica logs a warning at start-up.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from serve_app import errors
from serve_app.config import ModelConfig
from serve_app.engine.adapter import cache_salt, error_head
from serve_app.engine.backend import Answer, Diagnostics
from serve_app.engine.madeup import MadeUp, wants_usage
from serve_app.engine.sim.blocks import BlockPool
from serve_app.engine.sim.engine import Clock, ScaledClock, SimEngine, StepSink
from serve_app.engine.sim.profile import load_profile
from serve_app.engine.sim.scheduler import Limits, Scheduler, SimRequest
from serve_app.engine.sim.tokens import prompt_ids
from serve_app.protocol import (
    SSE_DONE,
    Endpoint,
    RequestContext,
    head,
    stream_error,
    tokens_of,
    trailer,
)

logger = logging.getLogger(__name__)

FINGERPRINT = "serve-app-simulated"
TOKEN_TEXT = "simulated "
# vLLM's defaults where the config leaves them unset (vLLM 0.32, online serving on a GPU).
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_BLOCK_SIZE = 16


def build_engine(cfg: ModelConfig, clock: Clock | None = None, sink: StepSink | None = None) -> SimEngine:
    """The ``SimEngine`` of a model with ``simulated`` settings, its limits from ``cfg.engine``."""
    sim = cfg.simulated
    if sim is None:
        raise ValueError(f"model {cfg.id!r} has no simulated settings")
    e = cfg.engine
    limits = Limits(max_num_seqs=e.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
                    max_num_batched_tokens=e.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
                    policy=e.scheduling_policy)
    pool = BlockPool(sim.num_blocks, e.block_size or DEFAULT_BLOCK_SIZE,
                     caching=e.enable_prefix_caching is not False)
    return SimEngine(Scheduler(limits, pool, seed=e.seed or 0), load_profile(sim.profile),
                     clock or ScaledClock(sim.time_scale), sink)


class SimServer:
    """A ``Backend`` that stands in for ``EngineServer`` with a simulated engine.

    ``clock`` and ``sink`` are for tests; by default the clock is scaled by ``time_scale`` and the
    sink is the replica's ``ray_vllm_*`` metrics, made at ``start``."""

    def __init__(self, cfg: ModelConfig, clock: Clock | None = None, sink: StepSink | None = None) -> None:
        self.cfg = cfg
        self.engine = build_engine(cfg, clock, sink)
        self.interval_s = cfg.stream_interval_ms / 1000.0
        self.answers = MadeUp(cfg.id, "simulated engine", "sim-", FINGERPRINT, TOKEN_TEXT)
        self.streamed_tokens = 0
        self._own_sink = sink is None

    async def start(self) -> None:
        sim = self.cfg.simulated
        assert sim is not None
        if self._own_sink:
            from serve_app.engine.sim.stats import RayEngineStats

            self.engine.sink = RayEngineStats(self.cfg.id, _replica_id())
        profile = self.engine.profile
        logger.warning(
            "SIMULATED engine for %s: no weights; profile %s (%s), time scale %.3g, %d KV blocks",
            self.cfg.id, profile.name, "fitted" if profile.fitted else "NOT fitted",
            sim.time_scale, sim.num_blocks)
        self.engine.start()

    async def check_health(self) -> None:
        if self.engine.error is not None or not self.engine.alive:
            raise RuntimeError("simulated engine stopped")

    def diagnostics(self) -> Diagnostics:
        sched = self.engine.scheduler
        return {"unfinished_requests": len(sched.running) + sched.num_waiting, "waiting_for_slot": 0,
                "streamed_tokens": self.streamed_tokens, "engine_dead": self.engine.error is not None}

    def shutdown(self) -> None:
        self.engine.stop()

    def _too_long(self, prompt: int, max_tokens: int) -> str | None:
        """Why a request can never run (vLLM refuses it before scheduling), else None."""
        limit = self.cfg.engine.max_model_len
        if limit is not None and prompt + max_tokens > limit:
            return (f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {prompt + max_tokens} tokens ({prompt} in the messages, "
                    f"{max_tokens} in the completion).")
        pool = self.engine.scheduler.pool
        if self.engine.scheduler.blocks_needed(prompt + max_tokens) > pool.num_blocks:
            return (f"This model's maximum context length is {pool.num_blocks * pool.block_size} "
                    f"tokens (its KV cache). However, you requested {prompt + max_tokens} tokens.")
        return None

    async def handle(
        self, endpoint: Endpoint, body: dict[str, Any], ctx: RequestContext
    ) -> AsyncIterator[Answer]:
        max_tokens = self.answers.max_tokens(endpoint, body)
        if not isinstance(max_tokens, int):
            yield max_tokens
            return
        ids = prompt_ids(body)
        reason = self._too_long(len(ids), max_tokens)
        if reason is not None:
            yield error_head(errors.ContextLengthExceeded(reason, param=endpoint.main_param), endpoint)
            return
        priority = ctx.priority if self.cfg.engine.scheduling_policy == "priority" else 0
        req = SimRequest(ctx.request_id or uuid.uuid4().hex, ids, max_tokens, priority,
                         cache_salt(ctx.tenant) or "")
        self.engine.submit(req)
        try:
            if body.get("stream") is True:
                async for item in self._stream(endpoint, body, req):
                    yield item
            else:
                await self.engine.wait(req, max_tokens - 1)
                if self.engine.error is not None:
                    yield error_head(_dead(), endpoint)
                    return
                yield head(200, self.answers.complete(endpoint, len(req.outputs), len(ids),
                                                      max(0, req.cached_tokens)),
                           tokens=tokens_of(len(ids), len(req.outputs)))
        finally:
            self.engine.abort(req)

    async def _stream(self, endpoint: Endpoint, body: dict[str, Any],
                      req: SimRequest) -> AsyncIterator[Answer]:
        base = self.answers.base(endpoint)
        prompt = len(req.prompt)
        sent = 0
        try:
            await self.engine.wait(req, 0)
            if self.engine.error is not None:
                yield error_head(_dead(), endpoint)
                return
            sent = len(req.outputs)
            finish = "length" if sent >= req.max_tokens else None
            yield head(200, self.answers.chunk(endpoint, base, sent, True, finish), stream=True,
                       tokens=tokens_of(prompt, sent))
            while sent < req.max_tokens:
                # As the real replica's pacing: at most one event per interval, tokens merged.
                if self.interval_s:
                    await asyncio.sleep(self.interval_s)
                await self.engine.wait(req, sent)
                if self.engine.error is not None:
                    yield stream_error(endpoint, _dead()), sent
                    yield trailer(prompt, sent)
                    return
                n = len(req.outputs) - sent
                sent += n
                finish = "length" if sent >= req.max_tokens else None
                yield self.answers.chunk(endpoint, base, n, False, finish), sent
            tail = (self.answers.usage_chunk(endpoint, base, prompt, sent, max(0, req.cached_tokens))
                    if wants_usage(body) else b"")
            yield tail + SSE_DONE, sent
            yield trailer(prompt, sent)
        finally:
            self.streamed_tokens += sent


def _dead() -> errors.ServiceUnavailable:
    return errors.ServiceUnavailable("the simulated engine stopped; the replica is being replaced")


def _replica_id() -> str:
    """This Ray Serve replica's id for the ``ReplicaId`` label ("" outside a replica)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:
        return ""
