"""Where each model replica serves its answers: a small named Ray actor per application.

Ray Serve gives no replica's address to anyone, so each model replica, once its engine and its
port are up, registers ``(model id, host, port)`` under its Ray Serve replica id, and drops it when
it stops. Gateway replicas read the whole table with their status refresh
(``gateway.routing.replicas``) and keep only the replicas that Ray Serve reports RUNNING, so an
entry left by a replica that was killed never gets traffic.

The actor also keeps the application's shared token, made once when the actor is first created:
a model replica answers only a request that carries it (``engine.endpoint``), so reaching its port
is not enough to skip the gateway's keys and limits. The actor is detached, so the token and the
table survive a ``serve deploy`` of a new config (old and new replicas keep talking) and only end
with the Ray cluster.
"""

from __future__ import annotations

import secrets
from typing import Any

import ray

NAMESPACE = "serve_app"
# Where model replicas listen, when set (``serve-app run`` sets 127.0.0.1); else the Ray node's address.
MODEL_HOST_ENV = "SERVE_APP_MODEL_HOST"
Entry = tuple[str, str, int]  # model id, host, port
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's own marker resource of the head node


class EndpointRegistry:
    """The table: replica id -> (model id, host, port); and the application's token."""

    def __init__(self) -> None:
        self._token = secrets.token_urlsafe(32)
        self._entries: dict[str, Entry] = {}

    def token(self) -> str:
        return self._token

    def put(self, replica_id: str, model_id: str, host: str, port: int) -> str:
        """Register (or re-register: replicas do every few seconds, so a restarted registry
        fills again) a replica; returns the token it must check."""
        self._entries[replica_id] = (model_id, host, port)
        return self._token

    def drop(self, replica_id: str) -> None:
        self._entries.pop(replica_id, None)

    def snapshot(self) -> tuple[str, dict[str, Entry]]:
        return self._token, dict(self._entries)


_actor_class: Any = None


def actor_name(app_name: str) -> str:
    return f"endpoints:{app_name}"


def registry(app_name: str) -> Any:
    """The application's registry actor, created on first use (by whichever replica starts first).
    If it is lost, the next call makes a new one; model replicas fill it again within
    ``REGISTER_EVERY_S`` (engine.deployment), and gateways take its new token from their next read."""
    global _actor_class
    if _actor_class is None:
        # On the head node (where Ray Serve's controller runs), not on a model node that may go.
        _actor_class = ray.remote(num_cpus=0, resources={HEAD_NODE_RESOURCE: 0.001})(EndpointRegistry)
    return _actor_class.options(
        name=actor_name(app_name), namespace=NAMESPACE, lifetime="detached",
        get_if_exists=True,
    ).remote()
