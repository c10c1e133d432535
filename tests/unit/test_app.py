"""serve_app.app: deployment options and app wiring, checked against Ray Serve's own validation.

Ray Serve's ``Deployment.options`` and ``build_app`` validate without a running cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from ray.serve._private.build_app import build_app as ray_build_app
from ray.serve.config import AutoscalingConfig as RayAutoscalingConfig

from serve_app.app import build_app, model_deployment_options, parse_args
from serve_app.config import APP_NAME, load_app_config
from serve_app.engine.deployment import ModelServer
from tests.unit.builders import app_config, app_doc, model, model_doc, tier

CONFIG_FILES = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.y*ml"))


def test_deployment_name_is_ray_safe() -> None:
    assert model(id="org/Model-1.5").deployment_name == "model-org-Model-1-5"


def test_ids_that_would_share_a_deployment_name_are_rejected() -> None:
    with pytest.raises(ValidationError, match="both become deployment 'model-a-b'"):
        app_config(model_doc(id="a.b"), model_doc(id="a-b"))


def test_fixed_replicas_default_to_one() -> None:
    opts = model_deployment_options(model())
    assert opts["num_replicas"] == 1
    assert "autoscaling_config" not in opts


def test_fixed_replicas_are_passed() -> None:
    opts = model_deployment_options(model(deployment={"num_replicas": 3}))
    assert opts["num_replicas"] == 3


def test_autoscaling_replaces_num_replicas() -> None:
    m = model(deployment={"autoscaling_config": {"min_replicas": 0, "max_replicas": 4}})
    opts = model_deployment_options(m)
    assert "num_replicas" not in opts
    assert opts["autoscaling_config"]["min_replicas"] == 0
    assert opts["autoscaling_config"]["max_replicas"] == 4
    assert "initial_replicas" not in opts["autoscaling_config"]  # None is left to Ray
    # Ray Serve accepts every key we send.
    ray_cfg = RayAutoscalingConfig(**opts["autoscaling_config"])
    assert ray_cfg.max_replicas == 4


def test_queue_and_concurrency_limits_are_passed() -> None:
    opts = model_deployment_options(
        model(deployment={"max_queued_requests": 7, "max_ongoing_requests": 5})
    )
    assert opts["max_queued_requests"] == 7
    assert opts["max_ongoing_requests"] == 5


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"engine": {"tensor_parallel_size": 2}, "accelerator": {"cpus_per_worker": 2}},
        {"engine": {"tensor_parallel_size": 2}, "accelerator": {"kind": "gpu", "type": "A10G"}},
        {"deployment": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}},
        {"env": {"A": "1"}, "deployment": {"max_queued_requests": 10}},
    ],
)
def test_ray_serve_accepts_model_deployment_options(over: dict[str, Any]) -> None:
    opts = model_deployment_options(model(**over))
    # Raises if, e.g., the actor does not fit in the first bundle or a value is out of range.
    d = ModelServer.options(**opts)
    assert d.name == opts["name"]


def test_parse_args_gives_readable_error() -> None:
    with pytest.raises(ValueError) as exc_info:
        parse_args(app_doc(model_doc(engine={"max_num_seqs": 0})))
    assert "invalid app config:" in str(exc_info.value)
    assert "models.0.engine.max_num_seqs: Input should be greater than 0 (got 0)" in str(
        exc_info.value
    )


def test_parse_args_accepts_validated_config() -> None:
    cfg = app_config()
    assert parse_args(cfg) is cfg


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_shipped_config_builds_gateway_plus_one_deployment_per_model(path: Path) -> None:
    cfg = load_app_config(path)
    built = ray_build_app(build_app(cfg), name=APP_NAME)
    names = {d.name for d in built.deployments}
    assert built.ingress_deployment_name == "gateway"
    assert names == {"gateway"} | {m.deployment_name for m in cfg.models}


def test_model_deployments_learn_the_top_tier_priority() -> None:
    cfg = app_config(default_tier="batch", tiers={"premium": tier(1), "batch": tier(9)})
    built = ray_build_app(build_app(cfg), name=APP_NAME)
    model = next(d for d in built.deployments if d.name == "model-m")
    assert model.init_args[2] == 1
