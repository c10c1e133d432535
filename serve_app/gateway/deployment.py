"""The gateway ingress deployment: builds its collaborators and serves ``api.build_api``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from ray import serve

from serve_app import logflush
from serve_app.config import AppConfig
from serve_app.gateway.admission import Admission
from serve_app.gateway.api import GatewayDeps, build_api
from serve_app.gateway.drain import Drain
from serve_app.gateway.forward import Forwarder
from serve_app.gateway.keys import KeyStore
from serve_app.gateway.outage import OutageGuard
from serve_app.gateway.pipeline import Pipeline
from serve_app.gateway.replicas import LiveReplicas, serve_status_fetch
from serve_app.gateway.limits import LimitBackend, MemoryBackend, RedisBackend
from serve_app.gateway.routing import Router
from serve_app.gateway.usage import MemoryUsageStore, RedisUsageStore, Usage, UsageStore
from serve_app.metrics import GatewayMetrics


@serve.deployment
@serve.ingress()
class Gateway:
    """One unified OpenAI-compatible front door for every model deployment."""

    def __init__(self, app_config: dict[str, Any], handles: dict[str, Any]) -> None:
        logflush.install()  # warnings and errors reach the replica log at once
        cfg = AppConfig.model_validate(app_config)
        redis_url = cfg.gateway.redis_url
        backend: LimitBackend = RedisBackend(redis_url) if redis_url else MemoryBackend()
        store: UsageStore = RedisUsageStore(redis_url) if redis_url else MemoryUsageStore()
        router = Router(cfg)
        usage = Usage(store, GatewayMetrics.create(cfg))
        # The one reader of Ray Serve's status, refreshed in a thread: admission sizes its bounds
        # by the running replicas, the outage guard asks whether a model has none, the drain
        # whether the app is being deleted.
        self.replicas = LiveReplicas(
            serve_status_fetch({m.id: m.deployment_name for m in cfg.models}),
            cfg.gateway.replicas_refresh_s,
        )
        self.replicas.start()
        self.admission = Admission(cfg, backend, self.replicas)
        outage = OutageGuard(cfg.gateway.unavailable_hold_s, self.replicas)
        drain = Drain(cfg.gateway.drain_timeout_s, self.replicas)
        forwarder = Forwarder(handles, cfg.gateway, outage, drain)
        self.deps = GatewayDeps(
            cfg=cfg,
            keys=KeyStore(Path(cfg.gateway.keys_file), cfg.gateway.keys_reload_interval_s),
            router=router,
            pipeline=Pipeline(cfg, router, self.admission, forwarder, usage),
            usage=usage,
        )

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self.deps)

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
            "keys_file": str(self.deps.keys.path),
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
        }

    async def __del__(self) -> None:
        """Ray Serve calls this when it stops the replica: the status thread ends and the Redis
        clients give their connections back."""
        self.replicas.stop()
        await self.admission.backend.close()
        await self.deps.usage.store.close()
