"""serve_app.engine.placement: placement-group bundles and replica actor options."""

from __future__ import annotations

from typing import Any

import pytest

from serve_app.config import ModelConfig
from serve_app.engine.placement import actor_options, placement_bundles, placement_strategy
from tests.unit.builders import model


def _fits_in_first_bundle(cfg: ModelConfig) -> None:
    opts = actor_options(cfg)
    first = placement_bundles(cfg)[0]
    assert opts["num_cpus"] <= first.get("CPU", 0)
    assert opts["num_gpus"] <= first.get("GPU", 0)


def test_gpu_tp2_gives_one_gpu_bundle_per_rank_packed() -> None:
    cfg = model(engine={"tensor_parallel_size": 2}, accelerator={"kind": "gpu", "cpus_per_worker": 2})
    assert placement_bundles(cfg) == [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]
    assert placement_strategy(cfg) == "STRICT_PACK"


def test_gpu_accelerator_type_is_requested_in_every_bundle() -> None:
    cfg = model(engine={"tensor_parallel_size": 2}, accelerator={"kind": "gpu", "type": "A10G"})
    bundles = placement_bundles(cfg)
    assert len(bundles) == 2
    for b in bundles:
        assert b["GPU"] == 1.0
        assert b["accelerator_type:A10G"] > 0


def test_gpu_bundles_are_independent_dicts() -> None:
    bundles = placement_bundles(model(engine={"tensor_parallel_size": 2}, accelerator={"kind": "gpu"}))
    bundles[0]["GPU"] = 99
    assert bundles[1]["GPU"] == 1.0


def test_gpu_tp_times_pp_ranks() -> None:
    cfg = model(
        engine={"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, accelerator={"kind": "gpu"}
    )
    assert len(placement_bundles(cfg)) == 4


def test_cpu_is_one_bundle_with_all_worker_cpus() -> None:
    cfg = model(engine={"tensor_parallel_size": 2}, accelerator={"kind": "cpu", "cpus_per_worker": 3})
    assert placement_bundles(cfg) == [{"CPU": 6.0}]
    assert placement_strategy(cfg) == "STRICT_PACK"


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"engine": {"tensor_parallel_size": 2}, "accelerator": {"cpus_per_worker": 1.5}},
        {"accelerator": {"kind": "gpu"}},
        {"engine": {"tensor_parallel_size": 4}, "accelerator": {"kind": "gpu", "cpus_per_worker": 2}},
    ],
)
def test_actor_fits_in_first_bundle(over: dict[str, Any]) -> None:
    _fits_in_first_bundle(model(**over))


def test_replica_actor_takes_no_gpu_itself() -> None:
    cfg = model(engine={"tensor_parallel_size": 2}, accelerator={"kind": "gpu"})
    assert actor_options(cfg)["num_gpus"] == 0


def test_env_vars_go_to_runtime_env() -> None:
    opts = actor_options(model(env={"VLLM_CPU_OMP_THREADS_BIND": "0"}))
    assert opts["runtime_env"] == {"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "0"}}


def test_no_env_means_no_runtime_env() -> None:
    assert "runtime_env" not in actor_options(model())


def test_custom_resources_go_into_the_replica_bundle_and_its_actor() -> None:
    cpu = model(engine={"tensor_parallel_size": 2}, accelerator={"resources": {"model_node": 0.01}})
    assert placement_bundles(cpu) == [{"CPU": 2.0, "model_node": 0.01}]
    assert actor_options(cpu)["resources"] == {"model_node": 0.01}
    gpu = model(engine={"tensor_parallel_size": 2},
               accelerator={"kind": "gpu", "resources": {"model_node": 0.01}})
    assert placement_bundles(gpu) == [{"CPU": 1.0, "GPU": 1.0, "model_node": 0.01}, {"CPU": 1.0, "GPU": 1.0}]
    _fits_in_first_bundle(gpu)
