"""Resolve a model ``source`` string to a local path the engine can load."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
PACKAGE_PREFIX = "package:"
BUILTINS = ("tiny-chat",)


class ModelSourceError(ValueError):
    """A model ``source`` that cannot be loaded: a configuration error, raised at start-up."""


def builtin_path(name: str, cache_dir: str) -> Path:
    return Path(cache_dir).expanduser() / "models" / name


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
