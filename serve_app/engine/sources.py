"""Resolve a model ``source`` string to a local path the engine can load."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from serve_app.config import AdapterConfig, ModelConfig

BUILTIN_PREFIX = "builtin:"
PACKAGE_PREFIX = "package:"
BUILTINS = ("tiny-chat",)


class ModelSourceError(ValueError):
    """A model ``source`` that cannot be loaded: a configuration error, raised at start-up."""


def builtin_path(name: str, cache_dir: str) -> Path:
    return Path(cache_dir).expanduser() / "models" / name


def builtin_adapter_path(name: str, cache_dir: str) -> Path:
    return Path(cache_dir).expanduser() / "adapters" / name


# vLLM's own default for max_lora_rank (vllm.config.lora.LoRAConfig).
VLLM_DEFAULT_MAX_LORA_RANK = 16


def resolve_adapter(adapter: AdapterConfig, cache_dir: str, max_rank: int | None) -> str:
    """The folder of one LoRA adapter: a builtin is built on first use; a folder must hold a PEFT
    adapter whose rank fits ``max_rank`` (the engine's ``max_lora_rank``), else a
    ``ModelSourceError`` names the adapter, before any engine starts."""
    if adapter.builtin is not None:
        from serve_app.engine.tiny_lora import build_tiny_lora

        return str(build_tiny_lora(builtin_adapter_path(adapter.builtin, cache_dir)))
    path = Path(adapter.source).expanduser()
    config = path / "adapter_config.json"
    if not config.is_file():
        raise ModelSourceError(
            f"adapter {adapter.name!r}: source {adapter.source!r} is not a folder with an "
            "adapter_config.json"
        )
    try:
        rank = int(json.loads(config.read_text()).get("r", 0))
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise ModelSourceError(
            f"adapter {adapter.name!r}: {config} is not a PEFT adapter config ({exc})"
        ) from None
    limit = max_rank or VLLM_DEFAULT_MAX_LORA_RANK
    if rank > limit:
        raise ModelSourceError(
            f"adapter {adapter.name!r}: rank ({rank}) is above engine.max_lora_rank ({limit})"
        )
    return str(path)


def resolve_adapters(cfg: ModelConfig, cache_dir: str) -> dict[str, str]:
    """Each adapter's name and folder (``resolve_adapter``), in the model's order."""
    return {a.name: resolve_adapter(a, cache_dir, cfg.engine.max_lora_rank) for a in cfg.adapters}


def resolve_source(source: str, cache_dir: str) -> str:
    """``builtin:tiny-chat`` is built on first use; ``package:pkg/sub`` is a folder inside an
    installed Python package; anything else is handed to vLLM unchanged (a path or a hub id)."""
    if source.startswith(BUILTIN_PREFIX):
        name = source.removeprefix(BUILTIN_PREFIX)
        if name not in BUILTINS:
            raise ModelSourceError(f"unknown builtin model {name!r}; known: {list(BUILTINS)}")
        from serve_app.engine.tiny_model import build_tiny_model

        return str(build_tiny_model(builtin_path(name, cache_dir)))
    if source.startswith(PACKAGE_PREFIX):
        pkg, _, sub = source.removeprefix(PACKAGE_PREFIX).partition("/")
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise ModelSourceError(f"model source {source!r}: Python package {pkg!r} is not installed")
        path = Path(next(iter(spec.submodule_search_locations))) / sub
        if not path.is_dir():
            raise ModelSourceError(f"model source {source!r}: {sub!r} is not a folder of {pkg!r}")
        return str(path)
    return source
