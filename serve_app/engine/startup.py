"""Start-up of a vLLM replica: the AsyncLLM engine, the client chain, and vLLM's serving objects.

The serving objects are vLLM's own (``init_app_state``, as its API server builds them), so chat
templating, tools, logprobs, ``response_format``, ``n``, ``stop`` and ``stream_options`` are all
vLLM's. They are built around the client chain of ``clients.py`` rather than the engine itself.
"""

from __future__ import annotations

import argparse
from typing import Any

from serve_app.config import ModelConfig
from serve_app.engine.clients import EngineClient
from serve_app.engine.pacing import PacedEngineClient
from serve_app.engine.slots import GatedEngineClient, SlotGate


def new_engine(
    cfg: ModelConfig, model_path: str, adapter_paths: dict[str, str] | None = None,
) -> tuple[Any, Any, argparse.Namespace]:
    """A started AsyncLLM for ``cfg``, its ``VllmConfig``, and the arguments vLLM's serving
    objects are built from (as its API server's command line would give them).

    ``adapter_paths`` (name: folder) become vLLM's ``lora_modules``: its serving layer loads them
    at start-up and applies one to a request whose ``model`` names it, as ``vllm serve
    --lora-modules`` does."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import FrontendArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    engine_args = AsyncEngineArgs(**cfg.engine_kwargs(model_path))
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    engine = AsyncLLM(
        vllm_config=vllm_config,
        executor_class=Executor.get_class(vllm_config),
        log_requests=False,
        log_stats=not engine_args.disable_log_stats,
        # vLLM's engine metrics through Ray's metrics agent (as ray_vllm_*), as Ray Serve LLM does.
        stat_loggers=[RayPrometheusStatLogger],
    )
    from vllm.entrypoints.openai.models.protocol import LoRAModulePath

    lora_modules = [LoRAModulePath(name=name, path=path, base_model_name=cfg.id)
                    for name, path in (adapter_paths or {}).items()]
    frontend = FrontendArgs(**cfg.frontend, lora_modules=lora_modules or None)
    return engine, vllm_config, argparse.Namespace(**(vars(frontend) | vars(engine_args)))


def client_chain(
    engine: EngineClient, cfg: ModelConfig, max_num_seqs: int, top_priority: int
) -> tuple[EngineClient, SlotGate | None]:
    """The chain vLLM's serving layer calls: pacing, then the slot gate (when the model reserves
    slots for ``top_priority``, the highest tier's priority), then the engine; and the gate."""
    client = engine
    gate = None
    if cfg.admission.reserved_slots:
        gate = SlotGate(max_num_seqs, cfg.admission.reserved_slots, top_priority)
        client = GatedEngineClient(client, gate)
    # Streams read the engine at most once per interval, so vLLM merges tokens in between.
    return PacedEngineClient(client, cfg.stream_interval_ms / 1000.0), gate


async def serving_objects(engine: Any, client: EngineClient, args: argparse.Namespace) -> tuple[Any, Any]:
    """vLLM's serving objects, by attribute name (``Endpoint.serving``), built around ``client``
    so that every ``generate`` call they make goes through the chain; and the engine's tasks."""
    from starlette.datastructures import State
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state

    state = State()
    tasks = await engine.get_supported_tasks()
    await init_app_state(client, state, args, supported_tasks=tasks)
    return state, tasks


def cache_vllm_envs() -> None:
    """vLLM reads its settings from os.environ on every access (several per streamed chunk); its
    engine and worker processes cache them once started, and so does this replica.
    (py-spy, c64: envs.__getattr__ and os.getenv took 4% of the replica's samples.)"""
    from vllm import envs

    envs.enable_envs_cache()
