"""``build_app(args)``: the only module that wires the gateway and the engines together.

Ray Serve config files point their ``import_path`` here; ``args`` is validated by ``AppConfig``.
"""

from __future__ import annotations

import time
from typing import Any, cast

from pydantic import ValidationError
from ray.serve import Application
from ray.serve.deployment import Deployment

from serve_app.config import AppConfig, ModelConfig, format_validation_error
from serve_app.engine.autoscale import autoscaling_options, top_tier_objective_s
from serve_app.engine.deployment import ModelServer
from serve_app.engine.placement import placement_options
from serve_app.gateway.deployment import Gateway

GATEWAY_DEPLOYMENT = "gateway"
DRAIN_MARGIN_S = 5.0


def parse_args(args: dict[str, Any] | AppConfig) -> AppConfig:
    if isinstance(args, AppConfig):
        return args
    try:
        return AppConfig.model_validate(args)
    except ValidationError as exc:
        # A plain ValueError with one line per problem reads well in `serve deploy` output.
        raise ValueError("invalid app config:\n" + format_validation_error(exc)) from None


def model_deployment_options(m: ModelConfig, objective_s: float | None = None) -> dict[str, Any]:
    """Ray Serve's options for model ``m``; ``objective_s`` (the top tier's TTFT objective) is
    needed when the model autoscales on it (``autoscaling_config.objective_policy``)."""
    d = m.deployment
    opts: dict[str, Any] = {
        "name": m.deployment_name,
        "max_ongoing_requests": d.max_ongoing_requests,
        "max_queued_requests": d.max_queued_requests,
        "health_check_period_s": d.health_check_period_s,
        "health_check_timeout_s": d.health_check_timeout_s,
        "graceful_shutdown_timeout_s": d.graceful_shutdown_timeout_s,
        "max_surge_percent": d.max_surge_percent,
        **placement_options(m),
    }
    if d.autoscaling_config is not None:
        opts["autoscaling_config"] = autoscaling_options(d.autoscaling_config, objective_s)
    else:
        opts["num_replicas"] = d.replicas
    return opts


def build_app(args: dict[str, Any] | AppConfig) -> Application:
    cfg = parse_args(args)
    # @serve.deployment turns the classes into Deployments; mypy still sees the classes.
    model_server = cast(Deployment, ModelServer)
    gateway = cast(Deployment, Gateway)
    handles = {
        m.id: model_server.options(**model_deployment_options(m, top_tier_objective_s(cfg))).bind(
            m.model_dump(mode="json"), cfg.cache_dir, cfg.top_priority
        )
        for m in cfg.models
    }
    # One `created` for the model cards of every gateway replica: when this app was built.
    created = int(time.time())
    return gateway.options(**gateway_options(cfg)).bind(cfg.model_dump(mode="json"), handles, created)


def gateway_options(cfg: AppConfig) -> dict[str, Any]:
    g = cfg.gateway
    return {
        "name": GATEWAY_DEPLOYMENT,
        "num_replicas": g.num_replicas,
        "max_ongoing_requests": g.max_ongoing_requests,
        # Ray Serve waits this long for the gateway's streams before it kills it: the drain's
        # bound plus a margin, so that no stream is cut mid-way (gateway/drain.py).
        "graceful_shutdown_timeout_s": g.http.drain_timeout_s + DRAIN_MARGIN_S,
        "max_surge_percent": g.max_surge_percent,
        "ray_actor_options": {"num_cpus": g.num_cpus,
                              **({"resources": dict(g.resources)} if g.resources else {})},
    }
