"""The model deployment: one Ray Serve replica = one ``backend.Backend`` (a vLLM engine, or the
synthetic upstream); it depends on that protocol only.

``handle`` serves every endpoint of ``protocol.ENDPOINTS`` and answers as a stream (a head, then
for a stream its chunks and a trailer), so the gateway handles every endpoint, streaming or not,
with one code path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, cast

from ray import serve

from serve_app.config import ModelConfig
from serve_app.engine.autoscale import TopTierWindow
from serve_app.engine.backend import Backend
from serve_app.engine.server import EngineServer
from serve_app.engine.sources import resolve_source
from serve_app.engine.synthetic import SyntheticServer
from serve_app.metrics import ProcessMetrics
from serve_app.protocol import ENDPOINTS, Head, RequestContext
from serve_app.runtime import logflush
from serve_app.runtime.procwatch import LoopWatch

logger = logging.getLogger("ray.serve")


class ModelService:
    """One model's backend and what wraps it, with no Ray Serve in it: built by ``create``, used by
    the model deployment below (the deployment path) and by ``engine.local`` inside the gateway's
    own process (``gateway.serve_model``). Start-up is bounded by ``startup_timeout_s``."""

    def __init__(self, cfg: ModelConfig, server: Backend, top_tier: TopTierWindow | None,
                 watch: LoopWatch) -> None:
        self.cfg = cfg
        self.server = server
        self.top_tier = top_tier
        self.watch = watch

    @classmethod
    async def create(cls, model: dict[str, Any], cache_dir: str, top_priority: int = 0) -> ModelService:
        """Validate the model's config, build its backend and start it (bounded)."""
        cfg = ModelConfig.model_validate(model)
        watch = LoopWatch(ProcessMetrics.for_this_replica("model"))
        watch.start()
        auto = cfg.deployment.autoscaling_config
        objective = auto.objective_policy if auto is not None else None
        # The top tier's TTFT and wait, for autoscale.ObjectivePolicy (record_autoscaling_stats).
        top_tier = (TopTierWindow(top_priority, objective.window_s)
                    if objective is not None else None)
        server: Backend
        if cfg.synthetic is not None:  # no engine: made-up tokens for gateway benchmarks
            server = SyntheticServer(cfg)
        else:
            path = await asyncio.to_thread(resolve_source, cfg.source, cache_dir)
            server = EngineServer(cfg, path, top_priority)
        try:
            await asyncio.wait_for(server.start(), cfg.startup_timeout_s)
        except BaseException as exc:
            watch.cancel()
            server.shutdown()
            if not isinstance(exc, TimeoutError):
                raise
            raise RuntimeError(
                f"engine for {cfg.id!r} did not start within {cfg.startup_timeout_s:.0f} s"
            ) from None
        return cls(cfg, server, top_tier, watch)

    async def handle(self, endpoint: str, body: dict[str, Any], ctx: dict[str, Any]) -> AsyncIterator[Any]:
        """One request of ``ENDPOINTS[endpoint]``, with the context the gateway decided. The head
        carries when this replica started the request and had its first item (``Head.timing``),
        so the gateway can tell Ray Serve's queue from the engine's time."""
        start = time.time()
        context = RequestContext.from_dict(ctx)
        track = (self.top_tier.begin(context, body.get("stream") is True, start)
                 if self.top_tier is not None else None)
        try:
            async for item in self.server.handle(ENDPOINTS[endpoint], body, context):
                if isinstance(item, dict) and "status" in item:  # the head (a Trailer has no status)
                    h = cast(Head, item)
                    h["timing"] = {"start": start, "first": time.time()}
                    if self.top_tier is not None:
                        self.top_tier.first(track, h["timing"]["first"],
                                            h["status"] == 200 and h["stream"])
                yield item
        finally:
            if self.top_tier is not None:
                self.top_tier.end(track)

    def stats(self) -> dict[str, Any]:
        """Engine facts for operators and tests: requests the engine holds, those waiting in this
        replica for a slot (``admission.reserved_slots``), and the completion tokens the engine
        has made for streamed requests since the replica started."""
        return {"model": self.cfg.id, "max_num_seqs": self.cfg.engine.max_num_seqs,
                **self.server.diagnostics()}

    def autoscaling_stats(self) -> dict[str, float]:
        """The top tier's TTFT and wait p95 over the window; nothing when that policy is off."""
        return self.top_tier.stats() if self.top_tier is not None else {}

    async def check_health(self) -> None:
        # Raises (a plain RuntimeError) when the engine core died; Ray Serve then replaces this
        # replica. The watchdog also exits the replica 0.5 s after the death (watchdog.py).
        await self.server.check_health()

    def shutdown(self) -> None:
        """Stop the engine and the loop watch (idempotent)."""
        self.watch.cancel()
        self.server.shutdown()


@serve.deployment
class ModelServer:
    """Ray Serve deployment wrapping one ``ModelService``: one replica, one backend."""

    # Ray Serve awaits an async constructor; mypy knows only synchronous ones.
    async def __init__(  # type: ignore[misc]
        self, model: dict[str, Any], cache_dir: str, top_priority: int = 0
    ) -> None:
        logflush.install()  # warnings and errors reach the replica log at once
        self.service = await ModelService.create(model, cache_dir, top_priority)

    async def handle(self, endpoint: str, body: dict[str, Any], ctx: dict[str, Any]) -> AsyncIterator[Any]:
        """One request (``ModelService.handle``): the gateway's one entry point on this replica."""
        async for item in self.service.handle(endpoint, body, ctx):
            yield item

    async def stats(self) -> dict[str, Any]:
        return self.service.stats()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's hook for custom autoscaling metrics (autoscale.ObjectivePolicy reads them)."""
        return self.service.autoscaling_stats()

    async def check_health(self) -> None:
        await self.service.check_health()

    def __del__(self) -> None:
        service = getattr(self, "service", None)  # absent if the constructor failed
        if service is not None:
            service.shutdown()
