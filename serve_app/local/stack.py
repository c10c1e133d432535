"""``serve-app run``: the embedded default as one ``LocalStack``.

``start`` makes what the app needs on this machine (the demo key, a local Redis for usage and limit
state, the tiny model, the front door's settings) and starts Ray; ``deploy`` starts Ray Serve and
deploys the app; ``wait_ready`` follows Ray Serve's status until the app runs; ``stop`` drains and
ends all of it. ``run`` does the four in order, between Ctrl-Cs: the first Ctrl-C drains
(``serve.delete`` of the app, then ``serve.shutdown``); a second one skips the drain.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from serve_app.config import APP_NAME, AppConfig
from serve_app.local import front_door, prometheus, say
from serve_app.local.demo_key import demo_key_in
from serve_app.local.redis_server import LocalRedis, LocalStateError, start_local_redis
from serve_app.local.tiny_model import ensure_tiny_lora, start_tiny_model_build
from serve_app.state.keys import KeysFileError

LOGS = "/tmp/ray/session_latest/logs"


class DeployFailed(RuntimeError):
    """The app failed to deploy, or was not ready in time (what went wrong was said already)."""


def app_status(status: Any) -> tuple[str, str]:
    """The app's state in a ``serve.status()`` answer and one ``deployment=STATUS`` word per
    deployment; ``NOT_STARTED`` before the app exists."""
    app = status.applications.get(APP_NAME)
    if app is None:
        return "NOT_STARTED", ""
    parts = [f"{name}={d.status.value}" for name, d in sorted(app.deployments.items())]
    return app.status.value, " ".join(parts)


def stop_on_signals() -> threading.Event:
    """SIGINT and SIGTERM set the returned event, so that the stack drains; a second one raises
    KeyboardInterrupt in the main thread, which skips the drain."""
    stopping = threading.Event()

    def _stop(*_: Any) -> None:
        if stopping.is_set():
            raise KeyboardInterrupt
        stopping.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    return stopping


class LocalStack:
    """The app and what it needs on this machine, on ``host:port``, with keys in ``keys_file``."""

    def __init__(self, cfg: AppConfig, *, host: str, port: int, keys_file: Path, ingress: str,
                 verbose: bool = False) -> None:
        self.cfg = cfg
        self.host = host
        self.port = port
        self.keys_file = keys_file.resolve()
        self.ingress = ingress
        self.verbose = verbose
        self.secret = ""
        self.redis: LocalRedis | None = None
        self.run_dir: Path | None = None
        self.prometheus: prometheus.Prometheus | None = None
        self.t0 = self.t_stage = time.monotonic()

    def stage_done(self, what: str) -> None:
        """Say that a stage of ``run`` ended, with its own time and the time since the start."""
        now = time.monotonic()
        say(f"{what}: {now - self.t_stage:.1f} s (total {now - self.t0:.1f} s)")
        self.t_stage = now

    @classmethod
    def from_config(cls, cfg: AppConfig, http_options: Mapping[str, Any] | None, *,
                    host: str | None = None, port: int | None = None, keys_file: str | None = None,
                    ingress: str = "haproxy", verbose: bool = False) -> LocalStack:
        """A stack for a Ray Serve config file's app and ``http_options``; the arguments given
        override the file's host, port and ``gateway.keys.file``."""
        http = dict(http_options or {})
        return cls(cfg, host=host or http.get("host", "127.0.0.1"),
                   port=port or int(http.get("port", 8000)),
                   keys_file=Path(keys_file or cfg.gateway.keys.file), ingress=ingress,
                   verbose=verbose)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    # ---- the parts ------------------------------------------------------------------------------
    def start(self) -> None:
        """The demo key, the state store, the front door, then Ray, with the tiny model built
        beside Ray's start-up (in a process of its own) when it is not in the cache yet. A keys
        file that cannot be read raises KeysFileError before anything starts."""
        self.t0 = self.t_stage = time.monotonic()
        secret_file = self.keys_file.parent / "demo-key.secret"
        if self.cfg.gateway.keys.store == "file":
            # The launcher's own file: its demo key is written even where the admin API may not.
            keys = self.cfg.gateway.keys.model_copy(update={"file": str(self.keys_file),
                                                            "read_only": False})
            self.secret = demo_key_in(self.cfg.gateway.model_copy(update={"keys": keys}),
                                      secret_file)
        self._start_state_store()
        if self.cfg.gateway.keys.store != "file":  # in the store the state dir holds
            self.secret = demo_key_in(self.cfg.gateway, secret_file)
        self.stage_done("demo key and state store")
        build = None
        if any(m.source == "builtin:tiny-chat" for m in self.cfg.models):
            build = start_tiny_model_build(self.cfg.cache_dir)
        self._start_ray()
        # Builtin adapters (seeded weights, a second or two) while the model's build may still run.
        for name in sorted({a.builtin for m in self.cfg.models for a in m.adapters if a.builtin}):
            ensure_tiny_lora(name, self.cfg.cache_dir)
        if build is not None:
            # Its lines went to this terminal as it went; the model replica needs the model.
            if build.wait() != 0:
                raise DeployFailed("the tiny chat model was not built (its error is above)")
            self.stage_done("tiny chat model ready")

    def _start_state_store(self) -> None:
        """Usage totals (and, with several gateway replicas, limit counters:
        ``state.limits.open_limits``) outlive a gateway replica in a local Redis, unless the
        config names a Redis of its own (redis_server.py). Without redis-server (or when the config
        names a ``gateway.state.dir`` of its own), usage and budgets go to SQLite in the state dir,
        which the audit log uses too: durable with nothing installed."""
        gw = self.cfg.gateway
        chosen_dir = gw.state.dir
        state_dir = Path(chosen_dir or self.keys_file.parent / "state").resolve()
        state: dict[str, Any] = {"dir": str(state_dir)}
        if gw.state.redis_url is None and chosen_dir is not None:
            say(f"usage, budgets and audit: SQLite in {state_dir} (gateway.state.dir)")
        elif gw.state.redis_url is None:
            try:
                self.redis = start_local_redis(self.keys_file.parent / "state")
                state["redis_url"] = self.redis.url
                atexit.register(self.redis.stop)  # also when start-up fails before stop()
                limits = gw.state.limits_store
                shared = limits == "redis" or (limits == "auto" and gw.num_replicas > 1)
                say(f"usage totals: local redis-server on {self.redis.url} (persisted in "
                    f"{self.redis.state_dir}); rate-limit counters "
                    f"{'shared there' if shared else 'in the gateway replica memory'}")
            except LocalStateError as exc:
                say(f"usage and budgets: SQLite in {state_dir}; rate-limit counters stay in each "
                    f"gateway's memory: {exc}")
        gw = gw.model_copy(update={
            "keys": gw.keys.model_copy(update={"file": str(self.keys_file)}),
            "state": gw.state.model_copy(update=state),
        })
        self.cfg = self.cfg.model_copy(update={"gateway": gw})

    def _start_ray(self) -> None:
        say("starting Ray (local, loopback only) ...")
        from serve_app.gateway.http.proxy_middleware import IMPORT_PATH
        from serve_app.runtime.registry import MODEL_HOST_ENV

        # Ray's HTTP servers read this when they start: it bounds the X-Request-Id they echo.
        os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", IMPORT_PATH)
        # Model replicas serve the gateway on this host only (engine.deployment.endpoint_host).
        os.environ.setdefault(MODEL_HOST_ENV, self.host if self.host != "0.0.0.0" else "127.0.0.1")
        # Ray Serve reads the ingress settings once, when ray.serve is first imported, in every
        # process: Ray's own (so before ray.init) and this one, which builds the app and its
        # deployment handles (so before the import; otherwise the handles between the gateway and
        # the models would not get the transport that front_door.py chooses).
        # Short: Ray adds a 56-character node directory, and HAProxy's socket path allows 97 characters.
        self.run_dir = Path(tempfile.mkdtemp(prefix="sa-", dir="/tmp"))
        front_door.apply(self.ingress, self.run_dir, self.host)
        if self.verbose:  # throughput mode keeps replica logs off stderr, which is what --verbose shows
            os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "1")
        say(f"HTTP ingress: {front_door.describe(self.ingress)}")
        import ray

        # Logical CPUs are scheduling tokens; engines pin their own threads (VLLM_CPU_OMP_THREADS_BIND).
        ray.init(
            num_cpus=max(8, os.cpu_count() or 1),
            include_dashboard=False,
            log_to_driver=self.verbose,
            configure_logging=True,
            logging_level=logging.WARNING,
        )
        self.stage_done("Ray started")

    def deploy(self) -> None:
        """Ray Serve on ``host:port``, and the app under APP_NAME (without waiting for it)."""
        from ray import serve

        from serve_app.app import build_app

        serve.start(http_options={"host": self.host, "port": self.port}, proxy_location="HeadOnly")
        self.stage_done("Ray Serve started")
        say(f"deploying {', '.join(m.id for m in self.cfg.models)} "
            "(engines take about half a minute on CPU) ...")
        serve._run(build_app(self.cfg), _blocking=False, name=APP_NAME, route_prefix="/")
        self.stage_done("app submitted")

    def wait_ready(self, timeout_s: float, stopping: threading.Event) -> bool:
        """Follow Ray Serve's status every 0.5 s, saying each change: True once the app runs, False
        if ``stopping`` is set first; DeployFailed (after saying why) if it failed or timed out."""
        from ray import serve

        t0 = time.monotonic()
        last = ""
        while not stopping.is_set():
            status = serve.status()
            state, detail = app_status(status)
            if detail != last:
                say(f"{time.monotonic() - t0:5.1f} s  {state}: {detail}")
                last = detail
            if state == "RUNNING":
                self.stage_done("replicas ready")
                say(f"ready {time.monotonic() - self.t0:.0f} s after the start. Paste these into a shell:")
                return True
            if state in ("DEPLOY_FAILED", "UNHEALTHY"):
                app = status.applications[APP_NAME]
                say(f"deployment failed: {app.message[-2000:]}")
                for name, d in app.deployments.items():
                    if d.message:
                        say(f"{name}: {d.message[-2000:]}")
                raise DeployFailed(state)
            if time.monotonic() - t0 > timeout_s:
                say(f"not ready after {timeout_s} s; logs are in {LOGS}")
                raise DeployFailed("timeout")
            stopping.wait(0.5)
        return False

    def announce(self, ready_file: str | None = None, with_prometheus: bool = False) -> None:
        """Print the base URL and the demo key, write ``ready_file`` for scripts, and start a
        Prometheus if asked."""
        print(f"OPENAI_BASE_URL={self.base_url}", flush=True)
        print(f"OPENAI_API_KEY={self.secret}", flush=True)
        say("Try it: curl -s $OPENAI_BASE_URL/chat/completions -H \"Authorization: Bearer "
            "$OPENAI_API_KEY\" -H 'Content-Type: application/json' -d '{\"model\": \"tiny-chat\", "
            "\"max_tokens\": 16, \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}'")
        say(f"Console: {self.base_url.removesuffix('/v1')}/console (sign in with an admin key: "
            ".venv/bin/serve-app keys create --id admin --role admin)")
        say(f"Ctrl-C stops everything. Logs: {LOGS}")
        if ready_file:
            Path(ready_file).write_text(json.dumps({"base_url": self.base_url}))
        if with_prometheus and self.run_dir is not None:
            self.prometheus = prometheus.start_for_ray(self.run_dir)

    def stop(self) -> None:
        """Drain, then stop Ray Serve, Ray, Prometheus and the local Redis."""
        import ray
        from ray import serve

        say("shutting down ...")
        if self.prometheus is not None:
            self.prometheus.stop()
        try:
            # Delete the app first, while Ray Serve's proxies still run: the gateways give their
            # streams gateway.http.drain_timeout_s to finish, then end them with an error event
            # (gateway/drain.py). serve.shutdown() stops the proxies at once, cutting streams.
            t_drain = time.monotonic()
            say(f"draining in-flight requests (at most {self.cfg.gateway.http.drain_timeout_s:.0f} s; "
                "Ctrl-C again to skip) ...")
            serve.delete(APP_NAME, _blocking=True)
            say(f"drained in {time.monotonic() - t_drain:.1f} s")
        except (Exception, KeyboardInterrupt) as exc:
            say(f"drain skipped: {exc.__class__.__name__}")
        try:
            serve.shutdown()  # type: ignore[no-untyped-call]
        finally:
            ray.shutdown()
            if self.run_dir is not None:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            if self.redis is not None:
                self.redis.stop()
        say("stopped")

    # ---- all of it ------------------------------------------------------------------------------
    def run(self, timeout_s: float, ready_file: str | None = None,
            with_prometheus: bool = False) -> int:
        """Start, deploy, wait until ready, announce, then wait for Ctrl-C and stop; the exit code
        (2: the keys file cannot be read; 1: the app did not become ready)."""
        try:
            self.start()
        except KeysFileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except DeployFailed:
            self.stop()
            return 1
        stopping = stop_on_signals()
        try:
            self.deploy()
            if self.wait_ready(timeout_s, stopping):
                self.announce(ready_file, with_prometheus)
            stopping.wait()
        except DeployFailed:
            return 1
        finally:
            self.stop()
        return 0
