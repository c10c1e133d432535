"""serve_app.config: strict schema, cross-field rules, readable errors, and the shipped config files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from serve_app.config import (
    Accelerator,
    AppConfig,
    AutoscalingConfig,
    DeploymentOptions,
    EngineArgs,
    GatewayConfig,
    HttpConfig,
    KeysFile,
    ModelConfig,
    format_validation_error,
    load_app_config,
)
from tests.unit.builders import DIGEST, app_doc, model_doc

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
CONFIG_FILES = sorted(CONFIGS_DIR.glob("*.yaml")) + sorted(CONFIGS_DIR.glob("*.yml"))
def _messages(exc_info: pytest.ExceptionInfo[ValidationError], root: str = "") -> str:
    return format_validation_error(exc_info.value, root)


# ---- unknown fields ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cls", "data", "field"),
    [
        (EngineArgs, {"max_num_seq": 8}, "max_num_seq"),
        (AutoscalingConfig, {"max_replica": 2}, "max_replica"),
        (DeploymentOptions, {"replicas": 2}, "replicas"),
        (Accelerator, {"gpus": 1}, "gpus"),
        (ModelConfig, model_doc(engin={}), "engin"),
        (GatewayConfig, {"keysfile": "k.yaml"}, "keysfile"),
        (AppConfig, app_doc(gatway={}), "gatway"),
    ],
)
def test_unknown_field_is_rejected_by_name(cls: type, data: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as exc_info:
        cls.model_validate(data)
    text = _messages(exc_info)
    assert field in text
    assert "Extra inputs are not permitted" in text


def test_nested_typo_is_reported_with_dotted_location() -> None:
    data = app_doc(model_doc(engine={"max_num_seq": 8}))
    with pytest.raises(ValidationError) as exc_info:
        AppConfig.model_validate(data)
    assert "models.0.engine.max_num_seq: Extra inputs are not permitted (got 8)" in (
        _messages(exc_info).splitlines()
    )


def test_format_validation_error_prefixes_root_and_shows_bad_value() -> None:
    data = app_doc(model_doc(engine={"max_num_seqs": 0}))
    with pytest.raises(ValidationError) as exc_info:
        AppConfig.model_validate(data)
    assert "args.models.0.engine.max_num_seqs: Input should be greater than 0 (got 0)" in (
        _messages(exc_info, "args").splitlines()
    )


def test_format_validation_error_one_line_per_problem() -> None:
    data = app_doc(model_doc(engine={"max_num_seqs": 0, "dtype": "int3"}))
    with pytest.raises(ValidationError) as exc_info:
        AppConfig.model_validate(data)
    # pydantic also reports the now-empty models tuple; only the engine lines matter here.
    lines = [ln for ln in _messages(exc_info).splitlines() if ln.startswith("models.0.")]
    assert len(lines) == 2
    assert any(line.startswith("models.0.engine.max_num_seqs:") for line in lines)
    assert any(line.startswith("models.0.engine.dtype:") and "'int3'" in line for line in lines)


def test_single_typo_gives_a_single_error_line() -> None:
    with pytest.raises(ValidationError) as exc_info:
        AppConfig.model_validate(app_doc(model_doc(engine={"max_num_seq": 8})))
    assert _messages(exc_info).splitlines() == [
        "models.0.engine.max_num_seq: Extra inputs are not permitted (got 8)"
    ]


# ---- autoscaling -------------------------------------------------------------------------------
def test_autoscaling_max_below_min_names_both_values() -> None:
    with pytest.raises(ValidationError) as exc_info:
        AutoscalingConfig(min_replicas=2, max_replicas=1)
    assert "max_replicas (1) must be >= min_replicas (2)" in _messages(exc_info)


def test_autoscaling_error_is_located_under_the_model() -> None:
    data = app_doc(model_doc(deployment={"autoscaling_config": {"min_replicas": 2, "max_replicas": 1}}))
    with pytest.raises(ValidationError) as exc_info:
        AppConfig.model_validate(data)
    assert (
        "models.0.deployment.autoscaling_config: max_replicas (1) must be >= min_replicas (2)"
        in _messages(exc_info).splitlines()
    )


@pytest.mark.parametrize("initial", [0, 5])
def test_autoscaling_initial_replicas_must_be_within_bounds(initial: int) -> None:
    with pytest.raises(ValidationError) as exc_info:
        AutoscalingConfig(min_replicas=1, max_replicas=4, initial_replicas=initial)
    assert f"initial_replicas ({initial}) must be between min_replicas (1) and max_replicas (4)" in (
        _messages(exc_info)
    )


def test_autoscaling_accepts_scale_to_zero() -> None:
    a = AutoscalingConfig(min_replicas=0, max_replicas=3, initial_replicas=0)
    assert (a.min_replicas, a.max_replicas, a.initial_replicas) == (0, 3, 0)


# ---- deployment options ------------------------------------------------------------------------
def test_num_replicas_and_autoscaling_are_exclusive() -> None:
    with pytest.raises(ValidationError) as exc_info:
        DeploymentOptions(num_replicas=2, autoscaling_config=AutoscalingConfig(max_replicas=3))
    assert "num_replicas (2) and autoscaling_config are exclusive" in _messages(exc_info)


def test_max_queued_requests_minus_one_means_unlimited() -> None:
    assert DeploymentOptions().max_queued_requests == -1
    assert DeploymentOptions(max_queued_requests=10).max_queued_requests == 10
    with pytest.raises(ValidationError):
        DeploymentOptions(max_queued_requests=-2)


def test_max_queued_requests_zero_is_rejected_at_load_time() -> None:
    # Ray Serve refuses 0 at deploy time; the schema catches it first, naming field and value.
    with pytest.raises(ValidationError) as exc_info:
        DeploymentOptions(max_queued_requests=0)
    assert "max_queued_requests (0)" in _messages(exc_info)


# ---- engine / accelerator / model --------------------------------------------------------------
def test_engine_extra_may_not_repeat_typed_fields() -> None:
    with pytest.raises(ValidationError) as exc_info:
        EngineArgs(extra={"max_num_seqs": 4, "swap_space": 1})
    text = _messages(exc_info)
    assert "max_num_seqs" in text and "repeats typed engine fields" in text
    assert "swap_space" not in text  # only the clashing name is reported


def test_engine_extra_passes_untyped_fields() -> None:
    assert EngineArgs(extra={"swap_space": 1}).extra == {"swap_space": 1}


@pytest.mark.parametrize("util", [0.0, 1.5])
def test_gpu_memory_utilization_bounds(util: float) -> None:
    with pytest.raises(ValidationError) as exc_info:
        EngineArgs(gpu_memory_utilization=util)
    assert "gpu_memory_utilization" in _messages(exc_info)


def test_cpu_model_refuses_ray_executor_backend() -> None:
    data = model_doc(engine={"distributed_executor_backend": "ray", "tensor_parallel_size": 2})
    with pytest.raises(ValidationError) as exc_info:
        ModelConfig.model_validate(data)
    text = _messages(exc_info)
    assert "distributed_executor_backend ('ray')" in text and "'mp'" in text


def test_gpu_model_accepts_ray_executor_backend() -> None:
    m = ModelConfig.model_validate(
        model_doc(engine={"distributed_executor_backend": "ray"}, accelerator={"kind": "gpu"})
    )
    assert m.engine.distributed_executor_backend == "ray"


def test_accelerator_type_needs_gpu() -> None:
    with pytest.raises(ValidationError) as exc_info:
        Accelerator(kind="cpu", type="A10G")
    assert "type ('A10G') is only valid with kind 'gpu'" in _messages(exc_info)


_RESERVE_OK = {"max_num_seqs": 8, "scheduling_policy": "priority"}


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"engine": {"scheduling_policy": "priority"}},
         "admission.reserved_slots (2) must be < engine.max_num_seqs (None); set max_num_seqs"),
        ({"engine": {**_RESERVE_OK, "max_num_seqs": 2}},
         "admission.reserved_slots (2) must be < engine.max_num_seqs (2)"),
        ({"engine": {"max_num_seqs": 8}},
         "admission.reserved_slots (2) needs engine.scheduling_policy 'priority'"),
        ({"engine": _RESERVE_OK, "task": "embed"},
         "admission.reserved_slots (2) needs a generate model, not embed"),
    ],
)
def test_reserved_slots_must_fit_a_priority_generate_engine(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as exc_info:
        ModelConfig.model_validate(model_doc(admission={"reserved_slots": 2}, **over))
    assert message in _messages(exc_info)


def test_reserved_slots_are_for_the_best_tier_priority() -> None:
    m = model_doc(admission={"reserved_slots": 2}, engine=_RESERVE_OK)
    cfg = AppConfig.model_validate(app_doc(m, default_tier="batch", tiers={
        "batch": {"priority": 10}, "premium": {"priority": -1}, "standard": {"priority": 0}}))
    assert cfg.models[0].admission.reserved_slots == 2
    assert cfg.top_priority == -1


def test_world_size_is_tp_times_pp() -> None:
    m = ModelConfig.model_validate(
        model_doc(engine={"tensor_parallel_size": 2, "pipeline_parallel_size": 3})
    )
    assert m.world_size == 6


@pytest.mark.parametrize("bad_id", ["", "-leading-dash", "has space", "x" * 200])
def test_model_id_pattern(bad_id: str) -> None:
    with pytest.raises(ValidationError) as exc_info:
        ModelConfig.model_validate(model_doc(id=bad_id))
    assert _messages(exc_info).startswith("id:")


def test_bad_alias_is_named() -> None:
    with pytest.raises(ValidationError) as exc_info:
        ModelConfig.model_validate(model_doc(aliases=["ok", "not ok"]))
    assert "alias ('not ok')" in _messages(exc_info)


# ---- app ----------------------------------------------------------------------------------------
def test_app_needs_at_least_one_model() -> None:
    with pytest.raises(ValidationError) as exc_info:
        AppConfig.model_validate({"models": []})
    assert _messages(exc_info).startswith("models:")


def test_duplicate_model_ids_rejected() -> None:
    with pytest.raises(ValidationError) as exc_info:
        AppConfig.model_validate(app_doc(model_doc(id="a"), model_doc(id="a", source="other")))
    assert "model name ('a') of model 'a' is already used by model 'a'" in _messages(exc_info)


def test_alias_clashing_with_other_model_id_rejected() -> None:
    data = app_doc(model_doc(id="a"), model_doc(id="b", aliases=["a"]))
    with pytest.raises(ValidationError) as exc_info:
        AppConfig.model_validate(data)
    assert "model name ('a') of model 'b' is already used by model 'a'" in _messages(exc_info)


def test_duplicate_alias_across_models_rejected() -> None:
    data = app_doc(model_doc(id="a", aliases=["x"]), model_doc(id="b", aliases=["x"]))
    with pytest.raises(ValidationError) as exc_info:
        AppConfig.model_validate(data)
    assert "model name ('x')" in _messages(exc_info)


def test_default_tier_must_exist() -> None:
    with pytest.raises(ValidationError) as exc_info:
        AppConfig.model_validate(app_doc(tiers={"premium": {"priority": 1}}))
    assert "default_tier ('standard') is not one of tiers ['premium']" in _messages(exc_info)


def test_model_lookup_by_id() -> None:
    cfg = AppConfig.model_validate(app_doc(model_doc(id="a"), model_doc(id="b")))
    assert cfg.model("b").id == "b"
    with pytest.raises(KeyError):
        cfg.model("missing")


def test_config_is_frozen() -> None:
    cfg = AppConfig.model_validate(app_doc())
    with pytest.raises(ValidationError):
        cfg.default_tier = "premium"  # type: ignore[misc]


def test_keys_file_rejects_duplicate_ids() -> None:
    rec = {"id": "k1", "digest": DIGEST}
    with pytest.raises(ValidationError) as exc_info:
        KeysFile.model_validate({"keys": [rec, rec]})
    assert "key id ('k1') appears twice" in _messages(exc_info)


def test_keys_file_rejects_plain_secret_as_digest() -> None:
    with pytest.raises(ValidationError) as exc_info:
        KeysFile.model_validate({"keys": [{"id": "k1", "digest": "sk-sa-plaintext"}]})
    assert _messages(exc_info, "keys").startswith("keys.keys.0.digest:")


# ---- load_app_config ---------------------------------------------------------------------------
def _write_serve_config(path: Path, *apps: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump({"applications": list(apps)}))
    return path


def test_load_app_config_picks_named_application(tmp_path: Path) -> None:
    p = _write_serve_config(
        tmp_path / "c.yaml",
        {"name": "one", "args": app_doc(model_doc(id="first"))},
        {"name": "two", "args": app_doc(model_doc(id="second"))},
    )
    assert load_app_config(p).models[0].id == "first"
    assert load_app_config(p, "two").models[0].id == "second"
    with pytest.raises(ValueError, match="no application named 'three'"):
        load_app_config(p, "three")


def test_load_app_config_without_applications(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("proxy_location: HeadOnly\n")
    with pytest.raises(ValueError, match="no applications"):
        load_app_config(p)


def test_load_app_config_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "empty.yaml"
    p.write_text("")
    with pytest.raises(ValueError, match="no applications"):
        load_app_config(p)


def test_configs_dir_has_files() -> None:
    assert CONFIG_FILES, f"no YAML config files found in {CONFIGS_DIR}"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[p.name for p in CONFIG_FILES])
def test_shipped_config_file_is_valid(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    apps = doc["applications"]
    assert apps
    for app in apps:
        assert app["import_path"] == "serve_app.app:build_app"
        cfg = load_app_config(path, app.get("name"))
        assert isinstance(cfg, AppConfig)


@pytest.mark.parametrize(("gateway", "line"), [
    ({"state": {"limits_store": "redis"}},
     "gateway: gateway.state.limits_store ('redis') needs gateway.state.redis_url"),
    ({"keys": {"store": "redis"}}, "gateway: gateway.keys.store ('redis') needs gateway.state.redis_url"),
    ({"keys": {"store": "sqlite"}}, "gateway: gateway.keys.store ('sqlite') needs gateway.state.dir"),
])
def test_a_store_needs_its_place_named_by_full_path(gateway: dict[str, Any], line: str) -> None:
    with pytest.raises(ValidationError) as exc_info:
        AppConfig.model_validate(app_doc(gateway=gateway))
    assert line in _messages(exc_info).splitlines()


def test_a_gateway_field_of_before_its_sections_is_refused_by_name() -> None:
    """The old flat names (docs/CONFIG.md lists their new places) fail like any unknown field."""
    with pytest.raises(ValidationError) as exc_info:
        AppConfig.model_validate(app_doc(gateway={"request_timeout_s": 600}))
    assert "gateway.request_timeout_s: Extra inputs are not permitted (got 600)" in (
        _messages(exc_info).splitlines()
    )


def test_max_body_bytes_is_bounded_by_the_replica_message_limit() -> None:
    assert HttpConfig(max_body_bytes=32 * 2**20).max_body_bytes == 32 * 2**20
    with pytest.raises(ValidationError) as info:
        HttpConfig(max_body_bytes=32 * 2**20 + 1)
    assert "max_body_bytes" in str(info.value) and "33554432" in str(info.value)
