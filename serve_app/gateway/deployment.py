"""The gateway ingress deployment: builds its collaborators and serves ``api.build_api``.

With ``gateway.serve_model`` (the in-gateway path) it also starts that model's engine in its own
process, through the starter ``app.py`` passes (``engine.local.start``: this package does not import
the engine's), and calls it like the other models' deployment handles."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from ray import serve
from ray.serve._private import constants as serve_constants

from serve_app.config import AppConfig
from serve_app.gateway.accounting.audit import Audit
from serve_app.gateway.accounting.timing import trusts_arrival_stamp
from serve_app.gateway.accounting.usage import Usage
from serve_app.gateway.admission.admission import Admission
from serve_app.gateway.admission.budgets import Budgets
from serve_app.gateway.admission.drain import Drain
from serve_app.gateway.forward import Forwarder, HandleClient
from serve_app.gateway.http.api import GatewayDeps, build_api
from serve_app.gateway.outage import OutageGuard
from serve_app.gateway.pipeline import Pipeline
from serve_app.gateway.routing.replicas import LiveReplicas, serve_status_fetch
from serve_app.gateway.routing.router import Router
from serve_app.metrics import AuditMetrics, FlowMetrics, GatewayMetrics, ProcessMetrics, StageMetrics
from serve_app.protocol import ModelClient
from serve_app.runtime import logflush, niceness
from serve_app.runtime.procwatch import LoopWatch
from serve_app.state import open_state
from serve_app.state.keys import keep_fresh

if TYPE_CHECKING:
    from serve_app.gateway.accounting.otel import StageSpans

logger = logging.getLogger("ray.serve")
NICENESS_EVERY_S = 5.0  # HAProxy is a new process after each reload; threads come and go


@serve.deployment
@serve.ingress()
class Gateway:
    """One unified OpenAI-compatible front door for every model deployment."""

    # Ray Serve awaits an async constructor; mypy knows only synchronous ones.
    async def __init__(  # type: ignore[misc]
        self, app_config: dict[str, Any], handles: dict[str, Any], created: int | None = None,
        serve_here: Callable[[dict[str, Any], str, int], Awaitable[Any]] | None = None,
    ) -> None:
        """``serve_here`` (``engine.local.start``, passed by ``app.py`` when
        ``gateway.serve_model`` is set) starts that model's engine in this process and returns
        its in-process ``ModelClient``; every other model is called over its Serve handle
        (``forward.HandleClient``)."""
        logflush.install()  # warnings and errors reach the replica log at once
        cfg = AppConfig.model_validate(app_config)
        deployments = {m.id: m.deployment_name for m in cfg.models}
        self.local: Any = None
        clients: dict[str, ModelClient] = {m: HandleClient(h) for m, h in handles.items()}
        served = cfg.served_model
        if served is not None and serve_here is not None:
            self.local = await serve_here(served.model_dump(mode="json"), cfg.cache_dir,
                                          cfg.top_priority)
            clients[served.id] = self.local
            # Its running replicas are this deployment's.
            deployments[served.id] = serve.get_replica_context().deployment
        # Every connection and store of this replica; the lifespan closes it once.
        self.state = state = open_state(cfg)
        self.budgets = Budgets(state.budgets, dict(cfg.gateway.accounting.tenant_budgets), time.time)
        router = Router(cfg)
        self.spans: StageSpans | None = None
        if cfg.gateway.accounting.otlp_endpoint:  # opentelemetry is imported only when it is configured
            from serve_app.gateway.accounting.otel import StageSpans as Spans

            self.spans = Spans.otlp(cfg.gateway.accounting.otlp_endpoint)
        usage = Usage(state.usage, GatewayMetrics.create(cfg), StageMetrics.create(), self.spans)
        self.niceness = cfg.gateway.front_end_niceness
        process_metrics = ProcessMetrics.for_this_replica("gateway")
        self.watch = LoopWatch(process_metrics)
        # The one reader of Ray Serve's status, refreshed in a thread: admission sizes its bounds
        # by the running replicas, the outage guard asks whether a model has none, the drain
        # whether the app is being deleted.
        self.replicas = LiveReplicas(
            serve_status_fetch(deployments),
            cfg.gateway.replicas_refresh_s,
        )
        self.replicas.start()
        drain = Drain(cfg.gateway.http.drain_timeout_s, self.replicas)
        self.admission = Admission(cfg, state.limits, self.replicas, usage, self.budgets, drain)
        self.admission.flow.attach(FlowMetrics.for_this_replica())
        outage = OutageGuard(cfg.gateway.http.unavailable_hold_s, self.replicas)
        forwarder = Forwarder(clients, cfg.gateway.http, outage, drain)
        self.deps = GatewayDeps(
            cfg=cfg,
            keys=state.keys,
            router=router,
            pipeline=Pipeline(cfg, router, self.admission, forwarder, usage),
            usage=usage,
            trust_arrival_stamp=trusts_arrival_stamp(serve_constants.RAY_SERVE_ENABLE_HA_PROXY,
                                                     os.environ),
            created=int(time.time()) if created is None else created,
            audit=Audit(state.audit, AuditMetrics.create()),
            budgets=self.budgets,
        )
        # OpenAI's Batch API: its routes' service, and this replica's runner, which feeds the
        # lines through this replica's own pipeline (serve_app/batch/runner.py).
        from serve_app.batch.wiring import build as build_batch

        self.deps.batch, self.batch_runner = build_batch(
            cfg, state, self.deps.pipeline.answer_line, self.deps.keys.by_id, process_metrics.tags["replica"])

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self.deps, self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """While the replica serves: its loop and CPU watched, the front end kept at
        ``gateway.front_end_niceness``; at its stop the state's connections are given back."""
        # The keys are loaded before the replica serves, then polled (lookups answer from memory).
        await self.deps.keys.refresh(force=True)
        keys_poll = asyncio.get_running_loop().create_task(keep_fresh(self.deps.keys))
        self.watch.start()
        nice = asyncio.get_running_loop().create_task(self._keep_niceness())
        self.batch_runner.start()
        try:
            yield
        finally:
            nice.cancel()
            keys_poll.cancel()
            await self.batch_runner.stop()
            await self.watch.stop()
            await self.state.close()
            if self.spans is not None:
                self.spans.shutdown()

    async def _keep_niceness(self) -> None:
        """Ray starts its workers, HAProxy included, at niceness 15, behind engines that busy-wait:
        the front door and this replica then wait for a core (ENVIRONMENT.md measured /health at
        p95 700 ms under load). Every thread of both goes to ``front_end_niceness``, again every
        few seconds (new threads, a reloaded HAProxy). The model replicas stay where Ray put them."""
        if self.niceness is None:
            return
        config = serve_constants.RAY_SERVE_HAPROXY_CONFIG_FILE_LOC
        while True:
            try:
                niceness.renice_process_threads(os.getpid(), self.niceness)
                if serve_constants.RAY_SERVE_ENABLE_HA_PROXY:
                    niceness.renice_haproxy(config, self.niceness)
            except PermissionError:
                logger.warning("front end left at Ray's niceness: lowering it needs root "
                               "(gateway.front_end_niceness: null silences this)")
                return
            except Exception:  # never let this take the replica down
                logger.warning("niceness not applied", exc_info=True)
            await asyncio.sleep(NICENESS_EVERY_S)

    def diagnostics(self) -> dict[str, Any]:
        """Facts about this replica for operators and tests: memory and heavy modules loaded."""
        import resource
        import sys

        heavy = sorted(
            m for m in ("vllm", "torch", "transformers", "serve_app.engine") if m in sys.modules
        )
        # ru_maxrss is in KiB on Linux.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {
            "heavy_modules": heavy,
            "peak_rss_bytes": peak,
            "keys_file": self.deps.keys.location,
            "model_transport": self.deps.pipeline.forwarder.transport,
            # Each model's replicas running now and the admission bounds they give.
            "models": {
                m.id: {
                    "running_replicas": self.admission.running(m.id),
                    "capacity": (b := self.admission.bounds(m.id))[0],
                    "saturation": b[1],
                    "inflight": self.admission.inflight[m.id] * self.deps.cfg.gateway.num_replicas,
                }
                for m in self.deps.cfg.models
            },
            # The flow queues (models with flow.enabled): bound, in flight, who waits how long.
            "flow": self.admission.flow.snapshot(),
        }

    async def check_health(self) -> None:
        """Ray Serve's health check: with a model served here, its engine's (a dead engine
        core fails it, and Ray Serve replaces the replica); otherwise always healthy."""
        if self.local is not None:
            await self.local.check_health()

    async def served_model_stats(self) -> dict[str, Any] | None:
        """The engine facts of the model served in this replica (``serve-app diagnose``)."""
        return await self.local.stats() if self.local is not None else None

    async def batches(self, limit: int = 20) -> list[dict[str, Any]]:
        """The latest batches of every tenant, for operators (serve-app diagnose): status, counts,
        and which runner of this replica holds them."""
        recent = await self.batch_runner.store.recent(limit)
        return [{"id": b.id, "status": b.status, "endpoint": b.endpoint, "tenant": b.owner,
                 "key_id": b.key_id, "created_at": b.created_at, "total": b.total,
                 "completed": b.completed, "failed": b.failed,
                 "running_here": b.id in self.batch_runner.running} for b in recent]

    def __del__(self) -> None:
        replicas = getattr(self, "replicas", None)  # absent if the constructor failed early
        if replicas is not None:
            replicas.stop()
        local = getattr(self, "local", None)
        if local is not None:
            local.shutdown()
