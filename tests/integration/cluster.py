"""A real Ray cluster driven by the commands the README's "Deploy" section gives: ``ray start --head``,
``serve deploy``, ``serve status``, ``serve shutdown``, ``ray stop``.

Unlike the session stack (``serve-app run``, which starts Ray inside its own process), this is the
production path: a Ray cluster started on its own, and the app deployed onto it as a config file
through Ray's dashboard. Everything stays on loopback: the head node binds 127.0.0.1, the dashboard
and the HTTP port too, and HAProxy's stats and metrics listeners are pinned to 127.0.0.1 by
``serve_app.local.front_door`` (on a real cluster, firewall them instead).

Ray gets 8 logical CPUs (``--num-cpus 8``) on this 2-core machine: logical CPUs are scheduling
tokens, and the second chat replica (autoscaling) and the surge replica of an update need them.
Each engine pins its own threads (``VLLM_CPU_OMP_THREADS_BIND``).

``ray stop`` stops every Ray process of this user on the machine, so a cluster test must never
run beside another stack: the ``cluster`` marker and tests/conftest.py's ordering hook run these
tests before the session stack starts, and local runs hold /tmp/serve-app-stack.lock.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loadtests.harness.stack import copy_config, driver_env
from serve_app.config import APP_NAME
from serve_app.local.ports import free_port
from tests.keys import create_key

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HOST = "127.0.0.1"
NUM_CPUS = 8


def _say(msg: str) -> None:
    print(f"[cluster] {msg}", flush=True)


def cluster_env(run_dir: Path) -> dict[str, str]:
    """The environment of every node (README "Deploy", step 3): Ray Serve's throughput mode with
    HAProxy, the X-Request-Id middleware, autoscaling metrics every second, loopback only."""
    from serve_app.gateway.http.proxy_middleware import IMPORT_PATH
    from serve_app.local import front_door

    env = dict(os.environ)
    env.update(front_door.haproxy_env(run_dir, HOST, front_door.haproxy_binary()))
    # serve-app run shortens this for a quick Ctrl-C; a cluster keeps Ray's default, so HAProxy
    # stops sending new requests to a stopping gateway replica before it closes (updates).
    env.pop("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", None)
    env.update({
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": IMPORT_PATH,
        # Replicas and handles report their ongoing requests every second (default 10 s), so the
        # autoscaler sees a load change within a second or two.
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
        "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
        # Ray workers import serve_app from this checkout.
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "RAY_AUTH_MODE": "token",
    })
    env.pop("RAY_ADDRESS", None)
    return env


@dataclass
class RayCluster:
    """A Ray cluster started with ``ray start`` and the app deployed on it with ``serve deploy``."""

    workdir: Path
    env: dict[str, str]
    gcs_port: int = field(default_factory=free_port)
    dashboard_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    started: bool = False
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def dashboard(self) -> str:
        return f"http://{HOST}:{self.dashboard_port}"

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.http_port}/v1"

    def run(self, argv: Sequence[str], timeout_s: float = 300, check: bool = True,
            extra_env: Mapping[str, str] | None = None,
            base_env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        env = {**(self.env if base_env is None else base_env), **(extra_env or {})}
        done = subprocess.run(list(argv), cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:3])} ... failed ({done.returncode}):\n"
                               f"{(done.stdout + done.stderr)[-3000:]}")
        return done

    # ---- README "Deploy", in order ----------------------------------------------------------------
    def start_head(self, num_cpus: int = NUM_CPUS, resources: Mapping[str, float] | None = None) -> None:
        # Token authentication (Ray's recommendation): a token in ~/.ray/auth_token, made once.
        self.run([str(BIN / "ray"), "get-auth-token", "--generate"], timeout_s=60)
        argv = [str(BIN / "ray"), "start", "--head", "--node-ip-address", HOST,
                "--port", str(self.gcs_port), "--num-cpus", str(num_cpus),
                "--dashboard-host", HOST, "--dashboard-port", str(self.dashboard_port),
                "--disable-usage-stats"]
        if resources:
            argv += ["--resources", json.dumps(dict(resources))]
        t0 = time.monotonic()
        self.started = True  # from here on, stop() must run ray stop
        self.run(argv, timeout_s=180)
        self.timings["ray_start_s"] = time.monotonic() - t0
        _say(f"ray start --head: {self.timings['ray_start_s']:.0f} s (GCS {HOST}:{self.gcs_port}, "
             f"{num_cpus} logical CPUs)")

    def deploy(self, config: Path) -> None:
        self.run([str(BIN / "serve"), "deploy", str(config), "-a", self.dashboard], timeout_s=120)

    def status(self) -> dict[str, Any]:
        done = self.run([str(BIN / "serve"), "status", "-a", self.dashboard], timeout_s=60)
        doc = yaml.safe_load(done.stdout) or {}
        return doc.get("applications", {}).get(APP_NAME) or {}

    def wait_running(self, timeout_s: float = 600, what: str = "the app",
                     ready: Callable[[dict[str, Any]], bool] | None = None) -> float:
        """Poll ``serve status`` until the app is RUNNING (and ``ready(status)``); the seconds."""
        t0 = time.monotonic()
        last = ""
        while True:
            app = self.status()
            state = app.get("status", "NOT_STARTED")
            line = state + " " + " ".join(
                f"{n}={d.get('status')}{d.get('replica_states') or ''}"
                for n, d in sorted((app.get("deployments") or {}).items()))
            if line != last:
                _say(f"{time.monotonic() - t0:5.0f} s  {line}")
                last = line
            if state == "RUNNING" and (ready is None or ready(app)):
                return time.monotonic() - t0
            if state in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise RuntimeError(f"{what}: {state}: {json.dumps(app)[-3000:]}")
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{what} not RUNNING after {timeout_s:.0f} s: {line}")
            time.sleep(1.0)

    def replicas(self, deployment: str, app: dict[str, Any] | None = None) -> dict[str, int]:
        """Replica states of one deployment, as ``serve status`` shows them."""
        app = self.status() if app is None else app
        d = (app.get("deployments") or {}).get(deployment) or {}
        return {k: int(v) for k, v in (d.get("replica_states") or {}).items()}

    def diagnose(self) -> dict[str, Any]:
        """The gateway's diagnostics through ``serve-app diagnose`` (running replicas, bounds)."""
        done = self.diagnose_raw()
        for line in done.stdout.splitlines():
            if line.startswith("gateway: "):
                return json.loads(line.removeprefix("gateway: "))  # type: ignore[no-any-return]
        raise RuntimeError(f"no gateway line in serve-app diagnose:\n{done.stdout[-2000:]}")

    def diagnose_raw(self) -> subprocess.CompletedProcess[str]:
        """``serve-app diagnose`` as an operator runs it: a driver connected to the cluster, in a
        plain environment (Ray Serve's throughput mode needs an event loop in a handle's caller)."""
        return self.run([sys.executable, "-m", "serve_app.cli", "diagnose"], timeout_s=60,
                        base_env=driver_env(f"{HOST}:{self.gcs_port}"),
                        extra_env={"PYTHONPATH": self.env["PYTHONPATH"]})

    def shutdown(self) -> None:
        self.run([str(BIN / "serve"), "shutdown", "-a", self.dashboard, "-y"], timeout_s=180)

    def stop(self) -> None:
        """``ray stop`` (then ``--force`` if anything is left); safe to call twice, and after a
        failure at any step."""
        if not self.started:
            return
        self.started = False
        done = self.run([str(BIN / "ray"), "stop"], timeout_s=120, check=False)
        if done.returncode != 0:
            self.run([str(BIN / "ray"), "stop", "--force"], timeout_s=60, check=False)
        _say("ray stop: done")


def write_config(src: Path, workdir: Path, port: int, keys_file: Path, redis_url: str,
                 edit: Callable[[dict[str, Any]], None] | None = None, name: str = "serve.yaml") -> Path:
    """A copy of ``src`` on ``port`` with the test's keys file and Redis (validated)."""

    def edit_all(args: dict[str, Any]) -> None:
        args["gateway"].setdefault("state", {})["redis_url"] = redis_url
        if edit is not None:
            edit(args)

    return copy_config(src, workdir / name, port=port, keys_file=keys_file, edit=edit_all)


def mounted_keys(workdir: Path, keys: Mapping[str, str]) -> tuple[Path, dict[str, str]]:
    """A keys file in a directory of its own, as a mounted Secret is (``keys``: id -> tier); the
    secrets made by the one KeyOps (tests/keys.py)."""
    folder = workdir / "keys"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "keys.yaml"
    return path, {kid: create_key(path, kid, tier, ["*"]) for kid, tier in keys.items()}
