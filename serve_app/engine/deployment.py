"""The model deployment: one Ray Serve replica = one ``backend.Backend`` (a vLLM engine, the
simulated engine or the synthetic upstream); it depends on that protocol only.

``ModelService.handle`` serves every endpoint of ``protocol.ENDPOINTS`` and answers as a stream (a
head, then for a stream its chunks and a trailer), so the gateway handles every endpoint, streaming
or not, with one code path. The gateway reaches it through the replica's own endpoint
(``engine.endpoint``, ``serve_app.wire``), never through a Ray Serve handle: Ray Serve owns the
replicas (placement groups, autoscaling, health checks, rolling updates), not the token path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, cast

from ray import serve

from serve_app.config import ModelConfig
from serve_app.engine.autoscale import ONGOING_METRIC, TopTierWindow
from serve_app.engine.backend import Backend
from serve_app.engine.endpoint import ModelEndpoint
from serve_app.engine.server import EngineServer
from serve_app.engine.sim.server import SimServer
from serve_app.engine.sources import resolve_adapters, resolve_source
from serve_app.engine.synthetic import SyntheticServer
from serve_app.metrics import ModelRequestMetrics, ProcessMetrics
from serve_app.protocol import ENDPOINTS, Head, RequestContext
from serve_app.runtime import logflush
from serve_app.runtime.procwatch import LoopWatch
from serve_app.runtime.registry import MODEL_HOST_ENV, registry

logger = logging.getLogger("ray.serve")
REGISTER_EVERY_S = 5.0
REQUESTS_GAUGE_EVERY_S = 1.0
DRAIN_MARGIN_S = 2.0  # Ray Serve kills the replica at graceful_shutdown_timeout_s: stop the engine first


class ModelService:
    """One model's backend and what wraps it, with no Ray Serve in it: built by ``create``, served
    by the model deployment below. Start-up is bounded by ``startup_timeout_s``."""

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
        elif cfg.simulated is not None:  # no engine: vLLM's scheduling in modelled time
            server = SimServer(cfg)
        else:
            path = await asyncio.to_thread(resolve_source, cfg.source, cache_dir)
            adapters = await asyncio.to_thread(resolve_adapters, cfg, cache_dir)
            server = EngineServer(cfg, path, top_priority, adapters, cache_dir)
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
    """Ray Serve deployment wrapping one ``ModelService``: one replica, one backend, and the
    replica's own streaming endpoint (``engine.endpoint``), registered under its replica id
    (``runtime.registry``) so that gateways send it requests directly."""

    # Ray Serve awaits an async constructor; mypy knows only synchronous ones.
    async def __init__(  # type: ignore[misc]
        self, model: dict[str, Any], cache_dir: str, top_priority: int = 0
    ) -> None:
        logflush.install()  # warnings and errors reach the replica log at once
        self.service = await ModelService.create(model, cache_dir, top_priority)
        context = serve.get_replica_context()
        self._replica_id = context.replica_id.unique_id
        self._app = context.app_name
        self._registry = registry(self._app)
        self._token: str = await self._registry.token.remote()
        self.endpoint = ModelEndpoint(self.service.handle, lambda: self._token, endpoint_host(),
                                      self.service.cfg.deployment.max_ongoing_requests)
        await self.endpoint.start()
        self._drain_s = self.service.cfg.deployment.graceful_shutdown_timeout_s
        await self._register()
        self._heartbeat = asyncio.get_running_loop().create_task(self._keep_registered())
        self._gauges = asyncio.get_running_loop().create_task(self._report_requests())
        logger.info("model %s serves on %s:%d", self.service.cfg.id, self.endpoint.host,
                    self.endpoint.port)

    async def _register(self) -> None:
        self._token = await self._registry.put.remote(
            self._replica_id, self.service.cfg.id, self.endpoint.host, self.endpoint.port)

    async def _keep_registered(self) -> None:
        """Register again every few seconds: a registry that restarted fills again, and a new
        token (a restarted registry makes one) reaches this replica."""
        while not self.endpoint.draining:
            await asyncio.sleep(REGISTER_EVERY_S)
            try:
                await self._register()
            except Exception as exc:  # the registry was lost: keep serving, make it again
                logger.warning("endpoint not registered: %s", exc.__class__.__name__)
                self._registry = registry(self._app)

    async def _report_requests(self) -> None:
        """The requests running and waiting here, each second (``serve_app_model_requests``)."""
        metrics = ModelRequestMetrics.for_this_replica()
        while not self.endpoint.draining:
            ep = self.endpoint
            metrics.seen(running=ep.running, waiting=ep.in_flight - ep.running)
            await asyncio.sleep(REQUESTS_GAUGE_EVERY_S)

    async def stats(self) -> dict[str, Any]:
        ep = self.endpoint
        return {**self.service.stats(), "in_flight": ep.in_flight, "running": ep.running,
                "served": ep.served, "endpoint": f"{ep.host}:{ep.port}"}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's hook for custom autoscaling metrics (autoscale.ObjectivePolicy reads them):
        the requests in flight here (Ray Serve does not see them) and the top tier's p95s."""
        return {ONGOING_METRIC: float(self.endpoint.in_flight), **self.service.autoscaling_stats()}

    async def check_health(self) -> None:
        await self.service.check_health()

    async def __del__(self) -> None:
        """Ray Serve's graceful stop (a scale-down, a rolling update, a deletion): leave the
        registry, refuse new requests (the gateway retries them elsewhere: nothing ran), let those
        in flight finish within ``graceful_shutdown_timeout_s``, then stop the engine."""
        service = getattr(self, "service", None)  # absent if the constructor failed
        endpoint = getattr(self, "endpoint", None)
        try:
            if endpoint is not None:
                endpoint.draining = True
                try:
                    await self._registry.drop.remote(self._replica_id)
                except Exception:
                    pass  # the registry's entry goes with the RUNNING filter anyway
                left = await endpoint.drain(max(0.0, self._drain_s - DRAIN_MARGIN_S))
                if left:
                    logger.warning("model replica stopping with %d requests in flight", left)
                endpoint.close()
        finally:
            if service is not None:
                service.shutdown()


def endpoint_host() -> str:
    """Where this replica listens: ``SERVE_APP_MODEL_HOST`` if set (``serve-app run`` sets the
    loopback address), else the Ray node's address, which other nodes' gateways reach."""
    import os

    import ray

    return os.environ.get(MODEL_HOST_ENV) or str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
