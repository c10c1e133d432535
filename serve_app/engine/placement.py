"""Placement-group bundles for a model replica, from its parallelism and accelerator.

GPU: one bundle per tensor/pipeline-parallel rank, each with one GPU, packed onto one node so the
ranks talk over NVLink/PCIe. The replica actor itself sits in the first bundle (Ray Serve's rule);
vLLM's ``ray`` executor places its workers in the others.

CPU: vLLM's ``mp`` executor forks its workers inside the replica's process tree, so the whole
replica is one bundle holding the CPUs of every rank.

Simulated (``simulated``): no engine runs, only one asyncio task that sleeps most of the time, so
the replica reserves no CPU and takes no placement group (Ray refuses a bundle of zeros); 8-32 of
them share a 2-core machine with the gateway.
"""

from __future__ import annotations

from typing import Any

from serve_app.config import ModelConfig


def placement_bundles(cfg: ModelConfig) -> list[dict[str, float]]:
    acc = cfg.accelerator
    if acc.kind == "cpu":
        return [{"CPU": acc.cpus_per_worker * cfg.world_size, **acc.resources}]
    bundle: dict[str, float] = {"CPU": acc.cpus_per_worker, "GPU": 1.0}
    if acc.type:
        bundle[f"accelerator_type:{acc.type}"] = 0.001
    bundles = [dict(bundle) for _ in range(cfg.world_size)]
    bundles[0].update(acc.resources)  # the replica actor's bundle
    return bundles


def placement_strategy(cfg: ModelConfig) -> str:
    # All ranks of one engine on one node; replicas themselves spread by Ray Serve.
    return "STRICT_PACK"


def placement_options(cfg: ModelConfig) -> dict[str, Any]:
    """Ray Serve's placement options of a model: its actor options and, unless it is simulated,
    its placement group."""
    opts: dict[str, Any] = {"ray_actor_options": actor_options(cfg)}
    if cfg.simulated is None:
        opts["placement_group_bundles"] = placement_bundles(cfg)
        opts["placement_group_strategy"] = placement_strategy(cfg)
    return opts


def actor_options(cfg: ModelConfig) -> dict[str, Any]:
    """Options for the replica actor; they must fit in the first bundle."""
    acc = cfg.accelerator
    if cfg.simulated is not None:
        num_cpus = 0.0
    elif acc.kind == "cpu":
        num_cpus = acc.cpus_per_worker * cfg.world_size
    else:
        num_cpus = acc.cpus_per_worker
    opts: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": 0}
    if acc.resources:
        opts["resources"] = dict(acc.resources)
    if cfg.env:
        opts["runtime_env"] = {"env_vars": dict(cfg.env)}
    return opts
