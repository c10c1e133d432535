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



@serve.deployment
class ModelServer:
    """Ray Serve deployment wrapping one backend. Start-up is bounded by ``startup_timeout_s``."""

    # Ray Serve awaits an async constructor; mypy knows only synchronous ones.
    async def __init__(  # type: ignore[misc]
        self, model: dict[str, Any], cache_dir: str, top_priority: int = 0
    ) -> None:
        logflush.install()  # warnings and errors reach the replica log at once
        self.cfg = ModelConfig.model_validate(model)
        self.watch = LoopWatch(ProcessMetrics.for_this_replica("model"))
        self.watch.start()
        auto = self.cfg.deployment.autoscaling_config
        objective = auto.objective_policy if auto is not None else None
        # The top tier's TTFT and wait, for autoscale.ObjectivePolicy (record_autoscaling_stats).
        self.top_tier = (TopTierWindow(top_priority, objective.window_s)
                         if objective is not None else None)
        self.server: Backend
        if self.cfg.synthetic is not None:  # no engine: made-up tokens for gateway benchmarks
            self.server = SyntheticServer(self.cfg)
        else:
            path = await asyncio.to_thread(resolve_source, self.cfg.source, cache_dir)
            self.server = EngineServer(self.cfg, path, top_priority)
        try:
            await asyncio.wait_for(self.server.start(), self.cfg.startup_timeout_s)
        except TimeoutError:
            self.server.shutdown()
            raise RuntimeError(
                f"engine for {self.cfg.id!r} did not start within {self.cfg.startup_timeout_s:.0f} s"
            ) from None

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

    async def stats(self) -> dict[str, Any]:
        """Engine facts for operators and tests: requests the engine holds, those waiting in this
        replica for a slot (``admission.reserved_slots``), and the completion tokens the engine
        has made for streamed requests since the replica started."""
        return {"model": self.cfg.id, "max_num_seqs": self.cfg.engine.max_num_seqs,
                **self.server.diagnostics()}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's hook for custom autoscaling metrics (autoscale.ObjectivePolicy reads them):
        the top tier's TTFT and wait p95 over the window; nothing when that policy is off."""
        return self.top_tier.stats() if self.top_tier is not None else {}

    async def check_health(self) -> None:
        # Raises (a plain RuntimeError) when the engine core died; Ray Serve then replaces this
        # replica. The watchdog also exits the replica 0.5 s after the death (watchdog.py).
        await self.server.check_health()

    def __del__(self) -> None:
        watch = getattr(self, "watch", None)
        if watch is not None:
            watch.cancel()
        server = getattr(self, "server", None)
        if server is not None:
            server.shutdown()
