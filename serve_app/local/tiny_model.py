"""The tiny chat model (and its builtin LoRA adapters) in the model cache: ``serve-app
build-tiny-model``, and ``serve-app run`` before it deploys a config that names them."""

from __future__ import annotations

import subprocess
import sys
import time

from serve_app.local import say


def ensure_tiny_model(cache_dir: str, force: bool = False) -> None:
    """Build the tiny chat model unless it is built already (or ``force``), saying what it does."""
    from serve_app.engine.sources import builtin_path
    from serve_app.engine.tiny_model import build_tiny_model, is_built

    path = builtin_path("tiny-chat", cache_dir)
    if is_built(path) and not force:
        say(f"tiny chat model already built at {path}")
        return
    say(f"building the tiny chat model at {path} (seeded weights, local tokenizer) ...")
    t0 = time.monotonic()
    build_tiny_model(path, force=force)
    say(f"built in {time.monotonic() - t0:.1f} s")


def ensure_tiny_lora(name: str, cache_dir: str) -> None:
    """Build the builtin adapter ``name`` unless it is built already, saying what it does."""
    from serve_app.engine.sources import builtin_adapter_path
    from serve_app.engine.tiny_lora import build_tiny_lora, is_built

    path = builtin_adapter_path(name, cache_dir)
    if is_built(path):
        say(f"tiny LoRA adapter {name} already built at {path}")
        return
    say(f"building the tiny LoRA adapter {name} at {path} (seeded weights) ...")
    build_tiny_lora(path)


def start_tiny_model_build(cache_dir: str) -> subprocess.Popen[bytes] | None:
    """``serve-app build-tiny-model`` in a process of its own, so that the build (about 7 s, most
    of it importing torch and transformers) runs beside Ray's start-up; None when it is built
    already (said here). Its lines go to this terminal."""
    from serve_app.engine.sources import builtin_path
    from serve_app.engine.tiny_model import is_built

    path = builtin_path("tiny-chat", cache_dir)
    if is_built(path):
        say(f"tiny chat model already built at {path}")
        return None
    return subprocess.Popen([sys.executable, "-m", "serve_app.cli", "build-tiny-model",
                             "--cache-dir", cache_dir])
