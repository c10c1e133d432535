"""Ray Serve config files as the commands read them: ``serve-app check-config`` and
``serve-app engine-args``, and the reading that every command taking ``--config`` shares (a bad
file is a message and exit code 1, never a traceback)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from serve_app.config import AppConfig, format_validation_error, load_app_config


def serve_doc(path: str) -> dict[str, Any]:
    """The file's YAML document; SystemExit unless it is a Ray Serve config file."""
    doc = yaml.safe_load(Path(path).read_text())
    if not isinstance(doc, dict) or not doc.get("applications"):
        raise SystemExit(f"{path}: not a Ray Serve config file (no 'applications')")
    return doc


def load_config(path: str) -> AppConfig:
    """The file's validated app config; SystemExit naming each bad field and value."""
    serve_doc(path)  # a file that is not a Ray Serve config gets its own message
    try:
        return load_app_config(path)
    except ValidationError as exc:
        raise SystemExit(
            f"{path}: invalid app config:\n{format_validation_error(exc, 'args')}"
        ) from None


def check_config(files: list[str]) -> int:
    """A line per file, ``ok`` with its model ids or its errors (on stderr); 1 if one is bad."""
    bad = 0
    for path in files:
        try:
            cfg = load_config(path)
            print(f"{path}: ok ({', '.join(m.id for m in cfg.models)})")
        except SystemExit as exc:
            print(exc, file=sys.stderr)
            bad += 1
    return 1 if bad else 0


def engine_args(config: str, model_id: str) -> int:
    """Print what the app gives vLLM for one model, as JSON, so that a plain vLLM server (the
    benchmark's baseline) can be started with the same settings; its adapters (name: folder)
    are vLLM's ``--lora-modules name=folder``."""
    from serve_app.engine.sources import ModelSourceError, resolve_adapters, resolve_source

    cfg = load_config(config)
    try:
        model = cfg.model(model_id)
    except KeyError:
        print(f"error: {config}: no model {model_id!r} (have {[m.id for m in cfg.models]})",
              file=sys.stderr)
        return 2
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the JSON alone
            path = resolve_source(model.source, cfg.cache_dir)  # builds builtin:tiny-chat if missing
            adapters = resolve_adapters(model, cfg.cache_dir)
    except ModelSourceError as exc:
        print(f"error: model {model.id!r}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({
        "model_path": path,
        "engine_kwargs": model.engine_kwargs(path),
        "frontend": dict(model.frontend),
        "env": dict(model.env),
        "adapters": adapters,
    }, indent=2))
    return 0
