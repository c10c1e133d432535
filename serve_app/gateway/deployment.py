"""The gateway ingress deployment: builds its collaborators and serves ``api.build_api``.

Each model is called through ``routing.direct.DirectClient``: the gateway picks the replica
(``routing.placement``) and streams from that replica's own endpoint; the model deployments' Serve
handles only tie them into the application (``serve-app diagnose`` reads their stats through Ray
Serve)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator
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
from serve_app.gateway.forward import Forwarder
from serve_app.gateway.http.api import GatewayDeps, build_api
from serve_app.gateway.outage import OutageGuard
from serve_app.gateway.pipeline import Pipeline
from serve_app.gateway.responses.service import StoredResponses
from serve_app.gateway.routing.adapters import RuntimeAdapters
from serve_app.gateway.routing.direct import DirectClient
from serve_app.gateway.routing.placement import Picker
from serve_app.gateway.routing.replicas import LiveReplicas, serve_status_fetch
from serve_app.gateway.routing.router import Router
from serve_app.metrics import (
    AuditMetrics,
    FlowMetrics,
    GatewayMetrics,
    ProcessMetrics,
    RouterMetrics,
    StageMetrics,
)
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
    ) -> None:
        """``handles``: the model deployments' Serve handles, bound by ``app.py`` so that Ray Serve
        deploys the models with the gateway; requests go to the replicas' endpoints instead."""
        logflush.install()  # warnings and errors reach the replica log at once
        cfg = AppConfig.model_validate(app_config)
        deployments = {m.id: m.deployment_name for m in cfg.models}
        # Every connection and store of this replica; the lifespan closes it once.
        self.state = state = open_state(cfg)
        self.budgets = Budgets(state.budgets, dict(cfg.gateway.accounting.tenant_budgets), time.time)
        self.adapters = RuntimeAdapters(state.adapters)
        router = Router(cfg, self.adapters)
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
        forwarder = Forwarder(self._clients(cfg, outage), cfg.gateway.http, outage, drain)
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
            responses=StoredResponses(state.responses, cfg.gateway.responses, state.keys.by_id),
            secrets=state.shared_secret,
            replicas=self.replicas,
        )
        # OpenAI's Batch API: its routes' service, and this replica's runner, which feeds the
        # lines through this replica's own pipeline (serve_app/batch/runner.py).
        from serve_app.batch.wiring import build as build_batch

        self.deps.batch, self.batch_runner = build_batch(
            cfg, state, self.deps.pipeline.answer_line, self.deps.keys.by_id, process_metrics.tags["replica"])

    def _clients(self, cfg: AppConfig, outage: OutageGuard) -> dict[str, ModelClient]:
        """One ``DirectClient`` per model, over the endpoints ``LiveReplicas`` keeps."""
        router_metrics = RouterMetrics.create()
        clients: dict[str, ModelClient] = {}
        for m in cfg.models:
            def decided(decision: str, name: str = m.deployment_name) -> None:
                router_metrics.routed(deployment=name, decision=decision)

            clients[m.id] = DirectClient(
                m.id, functools.partial(self.replicas.endpoints, m.id),
                lambda: self.replicas.token,
                Picker(m.affinity_routing, m.routing.load_factor, m.routing.max_keys),
                on_decision=decided if m.affinity_routing else None,
                on_failure=outage.saw_failure, on_empty=self.replicas.poke)
        return clients

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self.deps, self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """While the replica serves: its loop and CPU watched, the front end kept at
        ``gateway.front_end_niceness``; at its stop the state's connections are given back."""
        # The keys are loaded before the replica serves, then polled (lookups answer from memory).
        await self.deps.keys.refresh(force=True)
        keys_poll = asyncio.get_running_loop().create_task(keep_fresh(self.deps.keys))
        adapters_poll = asyncio.get_running_loop().create_task(self.adapters.keep_fresh())
        self.watch.start()
        nice = asyncio.get_running_loop().create_task(self._keep_niceness())
        self.batch_runner.start()
        try:
            yield
        finally:
            nice.cancel()
            keys_poll.cancel()
            adapters_poll.cancel()
            await self.batch_runner.stop()
            if self.deps.responses is not None:
                await self.deps.responses.close()  # background runs still going are failed, saying why
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
            # Where each model's RUNNING replicas serve, as this replica last read it.
            "endpoints": self.replicas.diagnostics()["endpoints"],
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
