"""Console entry point ``serve-app``: run the embedded default, manage keys, build the tiny model,
check config files, print a model's vLLM engine arguments and diagnose a running deployment."""

from __future__ import annotations

import argparse
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
from pathlib import Path
from typing import Any

import yaml

from serve_app.local import front_door

DEFAULT_CONFIG = "configs/local.yaml"
DEMO_KEY_ID = "local-demo"
APP_NAME = "llm"


def _say(msg: str) -> None:
    print(f"[serve-app] {msg}", flush=True)


def _serve_doc(path: str) -> dict[str, Any]:
    doc = yaml.safe_load(Path(path).read_text())
    if not isinstance(doc, dict) or not doc.get("applications"):
        raise SystemExit(f"{path}: not a Ray Serve config file (no 'applications')")
    return doc


def _load_config(path: str) -> Any:
    from pydantic import ValidationError

    from serve_app.config import format_validation_error, load_app_config

    _serve_doc(path)  # a file that is not a Ray Serve config gets its own message
    try:
        return load_app_config(path)
    except ValidationError as exc:
        raise SystemExit(
            f"{path}: invalid app config:\n{format_validation_error(exc, 'args')}"
        ) from None


# ---- keys ---------------------------------------------------------------------------------------
def _keys_path(ns: argparse.Namespace) -> Path:
    if ns.keys_file:
        return Path(ns.keys_file)
    return Path(_load_config(ns.config).gateway.keys_file)


def cmd_keys(ns: argparse.Namespace) -> int:
    from serve_app.gateway.keys import (
        KeysFileError,
        create_key,
        read_keys_file,
        revoke_key,
        rotate_key,
    )

    path = _keys_path(ns)
    try:
        if ns.keys_cmd == "create":
            models = [m for m in (ns.models or "*").split(",") if m]
            limits = {
                name: value
                for name in ("rpm", "tpm", "max_concurrent", "max_tokens_cap")
                if (value := getattr(ns, name)) is not None
            }
            secret = create_key(path, ns.id, ns.tier, models, tenant=ns.tenant, limits=limits)
            print(f"created key {ns.id!r} (tier {ns.tier}, models {','.join(models)}) in {path}")
            print("secret (shown once, store it now):")
            print(secret)
        elif ns.keys_cmd == "rotate":
            secret = rotate_key(path, ns.id)
            print(f"rotated key {ns.id!r} in {path}; the old secret stops working within seconds")
            print("new secret (shown once, store it now):")
            print(secret)
        elif ns.keys_cmd == "list":
            keys = read_keys_file(path).keys
            if not keys:
                print(f"no keys in {path}")
            for k in keys:
                state = "revoked" if k.revoked else "active"
                extra = f" limits={k.limits.model_dump(exclude_none=True)}" if k.limits else ""
                print(f"{k.id:24} {k.tier:10} {state:8} {','.join(k.models):24} {k.created_at}{extra}")
        elif ns.keys_cmd == "revoke":
            revoke_key(path, ns.id)
            print(f"revoked key {ns.id!r} in {path}")
    except KeysFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def ensure_demo_key(keys_file: Path, secret_file: Path) -> str:
    """A stable local demo key: reuse the stored secret while its digest is still active."""
    from serve_app.gateway.auth import digest
    from serve_app.gateway.keys import create_key, read_keys_file, revoke_key, write_keys_file

    keys = read_keys_file(keys_file)
    active = {k.digest for k in keys.keys if not k.revoked}
    if secret_file.exists():
        secret = secret_file.read_text().strip()
        if digest(secret) in active:
            return secret
    if any(k.id == DEMO_KEY_ID for k in keys.keys):
        revoke_key(keys_file, DEMO_KEY_ID)
        keys = read_keys_file(keys_file)
        write_keys_file(keys_file, type(keys)(keys=tuple(k for k in keys.keys if k.id != DEMO_KEY_ID)))
    secret = create_key(keys_file, DEMO_KEY_ID, "standard", ["*"])
    secret_file.parent.mkdir(parents=True, exist_ok=True)
    secret_file.write_text(secret + "\n")
    os.chmod(secret_file, 0o600)
    return secret


# ---- tiny model ---------------------------------------------------------------------------------
def cmd_build_tiny_model(ns: argparse.Namespace) -> int:
    from serve_app.engine.sources import builtin_path
    from serve_app.engine.tiny_model import build_tiny_model, is_built

    path = builtin_path("tiny-chat", ns.cache_dir)
    if is_built(path) and not ns.force:
        _say(f"tiny chat model already built at {path}")
        return 0
    _say(f"building the tiny chat model at {path} (seeded weights, local tokenizer) ...")
    t0 = time.monotonic()
    build_tiny_model(path, force=ns.force)
    _say(f"built in {time.monotonic() - t0:.1f} s")
    return 0


# ---- engine arguments ---------------------------------------------------------------------------
def cmd_engine_args(ns: argparse.Namespace) -> int:
    """Print what the app gives vLLM for one model, as JSON, so that a plain vLLM server (the
    benchmark's baseline) can be started with the same settings."""
    import contextlib

    from serve_app.engine.sources import ModelSourceError, resolve_source

    cfg = _load_config(ns.config)
    try:
        model = cfg.model(ns.model)
    except KeyError:
        print(f"error: {ns.config}: no model {ns.model!r} (have {[m.id for m in cfg.models]})",
              file=sys.stderr)
        return 2
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON alone
            path = resolve_source(model.source, cfg.cache_dir)  # builds builtin:tiny-chat if missing
    except ModelSourceError as exc:
        print(f"error: model {model.id!r}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({
        "model_path": path,
        "engine_kwargs": model.engine_kwargs(path),
        "frontend": dict(model.frontend),
        "env": dict(model.env),
    }, indent=2))
    return 0


# ---- config check -------------------------------------------------------------------------------
def cmd_check_config(ns: argparse.Namespace) -> int:
    bad = 0
    for path in ns.files:
        try:
            cfg = _load_config(path)
            print(f"{path}: ok ({', '.join(m.id for m in cfg.models)})")
        except SystemExit as exc:
            print(exc, file=sys.stderr)
            bad += 1
    return 1 if bad else 0


# ---- run ----------------------------------------------------------------------------------------
def _status_line(status: Any) -> tuple[str, str]:
    app = status.applications.get(APP_NAME)
    if app is None:
        return "NOT_STARTED", ""
    parts = [f"{name}={d.status.value}" for name, d in sorted(app.deployments.items())]
    return app.status.value, " ".join(parts)


def cmd_run(ns: argparse.Namespace) -> int:
    doc = _serve_doc(ns.config)
    cfg = _load_config(ns.config)
    http = dict(doc.get("http_options") or {})
    host = ns.host or http.get("host", "127.0.0.1")
    port = ns.port or int(http.get("port", 8000))

    keys_file = Path(ns.keys_file or cfg.gateway.keys_file).resolve()
    secret_file = keys_file.parent / "demo-key.secret"
    from serve_app.gateway.keys import KeysFileError

    try:
        secret = ensure_demo_key(keys_file, secret_file)
    except KeysFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    gateway_update: dict[str, Any] = {"keys_file": str(keys_file)}
    local_redis: Any = None
    if cfg.gateway.redis_url is None:
        # Usage totals and limit counters outlive a gateway replica (local_state.py).
        from serve_app.local.redis_server import LocalStateError, start_local_redis

        try:
            local_redis = start_local_redis(keys_file.parent / "state")
            gateway_update["redis_url"] = local_redis.url
            atexit.register(local_redis.stop)  # also when start-up fails before the try below
            _say(f"usage and limit state: local redis-server on {local_redis.url} "
                 f"(persisted in {local_redis.state_dir})")
        except LocalStateError as exc:
            _say(f"usage and limit state stay in each gateway's memory: {exc}")
    gateway = cfg.gateway.model_copy(update=gateway_update)
    cfg = cfg.model_copy(update={"gateway": gateway})

    if any(m.source == "builtin:tiny-chat" for m in cfg.models):
        cmd_build_tiny_model(argparse.Namespace(cache_dir=cfg.cache_dir, force=False))

    _say("starting Ray (local, loopback only) ...")
    from serve_app.gateway.proxy_middleware import IMPORT_PATH

    # Ray's HTTP servers read this when they start: it bounds the X-Request-Id they echo.
    os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", IMPORT_PATH)
    # Ray Serve reads the ingress settings once, when ray.serve is first imported, in every
    # process: Ray's own (so before ray.init) and this one, which builds the app and its
    # deployment handles (so before the import; otherwise the handles between the gateway and
    # the models would not get the transport that front_door.py chooses).
    # Short: Ray adds a 56-character node directory, and HAProxy's socket path allows 97 characters.
    run_dir = Path(tempfile.mkdtemp(prefix="sa-", dir="/tmp"))
    front_door.apply(ns.ingress, run_dir, host)
    if ns.verbose:  # throughput mode keeps replica logs off stderr, which is what --verbose shows
        os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "1")
    _say(f"HTTP ingress: {front_door.describe(ns.ingress)}")
    import ray
    from ray import serve

    from serve_app.app import build_app
    # Logical CPUs are scheduling tokens; engines pin their own threads (VLLM_CPU_OMP_THREADS_BIND).
    ray.init(
        num_cpus=max(8, os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=ns.verbose,
        configure_logging=True,
        logging_level=logging.WARNING,
    )
    stop = threading.Event()

    def _stop(*_: Any) -> None:
        if stop.is_set():  # a second Ctrl-C skips the drain
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    code = 0
    prom: Any = None
    try:
        serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
        _say(f"deploying {', '.join(m.id for m in cfg.models)} (engines take about a minute on CPU) ...")
        serve._run(build_app(cfg), _blocking=False, name=APP_NAME, route_prefix="/")
        t0 = time.monotonic()
        last = ""
        while not stop.is_set():
            state, detail = _status_line(serve.status())
            if detail != last:
                _say(f"{time.monotonic() - t0:5.0f} s  {state}: {detail}")
                last = detail
            if state == "RUNNING":
                break
            if state in ("DEPLOY_FAILED", "UNHEALTHY"):
                app = serve.status().applications[APP_NAME]
                _say(f"deployment failed: {app.message[-2000:]}")
                for name, d in app.deployments.items():
                    if d.message:
                        _say(f"{name}: {d.message[-2000:]}")
                return 1
            if time.monotonic() - t0 > ns.timeout:
                _say(f"not ready after {ns.timeout} s; logs are in /tmp/ray/session_latest/logs")
                return 1
            stop.wait(2.0)
        if not stop.is_set():
            _say(f"ready in {time.monotonic() - t0:.0f} s. Paste these into a shell:")
            print(f"OPENAI_BASE_URL=http://{host}:{port}/v1", flush=True)
            print(f"OPENAI_API_KEY={secret}", flush=True)
            _say("Ctrl-C stops everything. Logs: /tmp/ray/session_latest/logs")
            if ns.ready_file:
                Path(ns.ready_file).write_text(json.dumps({"base_url": f"http://{host}:{port}/v1"}))
            if ns.prometheus:
                prom = _start_prometheus(run_dir)
        stop.wait()
    finally:
        _say("shutting down ...")
        if prom is not None:
            prom.stop()
        try:
            # Delete the app first, while Ray Serve's proxies still run: the gateways give their
            # streams gateway.drain_timeout_s to finish, then end them with an error event
            # (gateway/drain.py). serve.shutdown() stops the proxies at once, cutting streams.
            t_drain = time.monotonic()
            _say(f"draining in-flight requests (at most {cfg.gateway.drain_timeout_s:.0f} s; "
                 "Ctrl-C again to skip) ...")
            serve.delete(APP_NAME, _blocking=True)
            _say(f"drained in {time.monotonic() - t_drain:.1f} s")
        except (Exception, KeyboardInterrupt) as exc:
            _say(f"drain skipped: {exc.__class__.__name__}")
        try:
            serve.shutdown()  # type: ignore[no-untyped-call]
        finally:
            ray.shutdown()
            shutil.rmtree(run_dir, ignore_errors=True)
            if local_redis is not None:
                local_redis.stop()
        _say("stopped")
    return code


# ---- observability --------------------------------------------------------------------------------
def _start_prometheus(run_dir: Path) -> Any:
    """A Prometheus on 127.0.0.1 scraping this Ray cluster, with the alert rules; None without one."""
    import ray

    from serve_app.local.prometheus import Prometheus, find_binary, targets_from_nodes, write_sd_file

    if find_binary() is None:
        _say("--prometheus: no prometheus binary (sudo bash scripts/system-deps.sh installs it)")
        return None
    nodes = ray.nodes()  # type: ignore[no-untyped-call]
    sd = write_sd_file(run_dir / "prometheus" / "ray_sd.json", targets_from_nodes(nodes))
    rules = Path(__file__).resolve().parents[1] / "dashboards" / "alerts.yaml"
    prom = Prometheus(run_dir / "prometheus", sd, rule_files=[rules] if rules.exists() else [])
    try:
        url = prom.start()
    except RuntimeError as exc:
        _say(f"--prometheus: {exc}")
        return None
    _say("Prometheus (scraping Ray's metrics export, alert rules loaded):")
    print(f"PROMETHEUS_URL={url}", flush=True)
    return prom


def cmd_dashboards(ns: argparse.Namespace) -> int:
    from serve_app.ops.grafana_push import DASHBOARD_DIR, push

    files = sorted(Path(ns.dir or DASHBOARD_DIR).glob("*.json"))
    if not files:
        raise SystemExit(f"no dashboard JSON in {ns.dir or DASHBOARD_DIR}")
    token = ns.token or os.environ.get("GRAFANA_TOKEN")
    try:
        urls = push(ns.url, token, ns.folder, files)
    except Exception as exc:  # grafana-client raises its own hierarchy; show it, without a traceback
        raise SystemExit(f"push to {ns.url} failed: {type(exc).__name__}: {exc}") from None
    for f, url in zip(files, urls, strict=True):
        print(f"{f.name}: {ns.url.rstrip('/')}{url}")
    return 0


# ---- diagnose -----------------------------------------------------------------------------------
def cmd_diagnose(ns: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from serve_app.app import GATEWAY_DEPLOYMENT

    ray.init(address="auto", log_to_driver=False, logging_level=logging.ERROR)
    status = serve.status()
    state, detail = _status_line(status)
    print(f"app {APP_NAME}: {state} {detail}")
    if state == "RUNNING":
        gw = serve.get_deployment_handle(GATEWAY_DEPLOYMENT, app_name=APP_NAME)
        print("gateway:", json.dumps(gw.diagnostics.remote().result(timeout_s=10)))
        # One replica of each model answers: requests in its engine, and those waiting in the
        # replica for a slot (admission.reserved_slots keeps some for the top tier).
        for name in sorted(status.applications[APP_NAME].deployments):
            if name != GATEWAY_DEPLOYMENT:
                model = serve.get_deployment_handle(name, app_name=APP_NAME)
                print(f"{name}:", json.dumps(model.stats.remote().result(timeout_s=10)))
    return 0


# ---- doctor -------------------------------------------------------------------------------------
def cmd_doctor(ns: argparse.Namespace) -> int:
    from serve_app.ops import doctor

    key = ns.api_key or os.environ.get("OPENAI_API_KEY", "")
    if not key:
        print("error: pass --api-key or set OPENAI_API_KEY", file=sys.stderr)
        return 2
    return doctor.run(ns.base_url, key)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="serve-app", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="run a config locally (the embedded default by default)")
    run.add_argument("--config", default=DEFAULT_CONFIG)
    run.add_argument("--host")
    run.add_argument("--port", type=int)
    run.add_argument("--keys-file", help="override the config's gateway.keys_file")
    run.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for readiness")
    run.add_argument("--ready-file", help="write a JSON file here once ready (for scripts)")
    run.add_argument("--verbose", action="store_true", help="stream replica logs to this terminal")
    run.add_argument("--ingress", choices=front_door.MODES,
                     default=os.environ.get("SERVE_APP_INGRESS", "haproxy"),
                     help="HTTP front door: HAProxy with the gateway replicas serving HTTP directly "
                          "(default, fastest), or Ray Serve's Python proxy actor "
                          "(default from SERVE_APP_INGRESS)")
    run.add_argument("--prometheus", action="store_true",
                     help="also start a Prometheus on 127.0.0.1 that scrapes Ray's metrics export "
                          "(needs Debian's prometheus package) and print its URL")
    run.set_defaults(func=cmd_run)

    db = sub.add_parser("dashboards", help="upload the generated Grafana dashboards")
    dsub = db.add_subparsers(dest="dashboards_cmd", required=True)
    dp = dsub.add_parser("push", help="create or overwrite the dashboards on a Grafana server")
    dp.add_argument("--url", required=True, help="Grafana base URL, e.g. http://127.0.0.1:3000")
    dp.add_argument("--token", help="service-account token (default: $GRAFANA_TOKEN)")
    dp.add_argument("--folder", default="serve-app", help="Grafana folder (created if missing)")
    dp.add_argument("--dir", help="folder of dashboard JSON (default: dashboards/grafana)")
    db.set_defaults(func=cmd_dashboards)

    keys = sub.add_parser("keys", help="create, list, rotate and revoke API keys")
    keys.add_argument("--config", default=DEFAULT_CONFIG)
    keys.add_argument("--keys-file", help="defaults to the config's gateway.keys_file")
    # The same two options after the subcommand too (`keys create --keys-file F ...`).
    key_opts = argparse.ArgumentParser(add_help=False)
    key_opts.add_argument("--config", default=argparse.SUPPRESS)
    key_opts.add_argument("--keys-file", default=argparse.SUPPRESS)
    ksub = keys.add_subparsers(dest="keys_cmd", required=True)
    kc = ksub.add_parser("create", parents=[key_opts], help="create a key and print its secret once")
    kc.add_argument("--id", required=True)
    kc.add_argument("--tier", default="standard")
    kc.add_argument("--models", default="*", help="comma-separated model ids or aliases, or *")
    kc.add_argument("--tenant", help="keys of one tenant share the prefix cache (default: the key id)")
    for name in ("rpm", "tpm", "max_concurrent", "max_tokens_cap"):
        kc.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int,
                        help=f"override the tier's per-key {name}")
    ksub.add_parser("list", parents=[key_opts], help="list keys (never secrets)")
    kro = ksub.add_parser("rotate", parents=[key_opts],
                          help="replace a key's secret; the old one stops working")
    kro.add_argument("--id", required=True)
    kr = ksub.add_parser("revoke", parents=[key_opts], help="revoke a key")
    kr.add_argument("--id", required=True)
    keys.set_defaults(func=cmd_keys)

    bt = sub.add_parser("build-tiny-model", help="build the tiny chat model into the cache")
    bt.add_argument("--cache-dir", default="~/.cache/serve-app")
    bt.add_argument("--force", action="store_true")
    bt.set_defaults(func=cmd_build_tiny_model)

    ea = sub.add_parser("engine-args", help="print the vLLM engine arguments of one model as JSON "
                                            "(model_path, engine_kwargs, frontend, env)")
    ea.add_argument("--config", default=DEFAULT_CONFIG)
    ea.add_argument("--model", required=True, help="model id in the config")
    ea.set_defaults(func=cmd_engine_args)

    cc = sub.add_parser("check-config", help="validate Ray Serve config files against the schema")
    cc.add_argument("files", nargs="+")
    cc.set_defaults(func=cmd_check_config)

    dg = sub.add_parser("diagnose", help="status of the running app and its gateway replica")
    dg.set_defaults(func=cmd_diagnose)

    dr = sub.add_parser("doctor", help="check a running gateway as a client sees it, and name fixes")
    dr.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
                    help="the gateway's base URL, with /v1 (default: OPENAI_BASE_URL)")
    dr.add_argument("--api-key", help="the key to check (default: OPENAI_API_KEY)")
    dr.set_defaults(func=cmd_doctor)

    ns = p.parse_args(argv)
    return int(ns.func(ns))


if __name__ == "__main__":
    sys.exit(main())
