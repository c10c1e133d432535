"""Keys for tests and their helpers, made through the one ``KeyOps`` (serve_app/gateway/keys/ops.py)
over the YAML keys file. Synchronous, for tests and fixtures that run outside an event loop (or
inside one: then the store's coroutine runs in a thread of its own)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from serve_app.gateway.keys.ops import KeyOps
from serve_app.state.keys import FileKeyStore, KeyStore

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``coro`` run to its end from synchronous code."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def loaded(store: KeyStore) -> KeyStore:
    """``store`` with its keys read into memory, as a gateway replica's start does."""
    run(store.refresh(force=True))
    return store


def file_store(path: Path, interval_s: float = 1.0,
               clock: Callable[[], float] = time.monotonic) -> FileKeyStore:
    """The keys file's store, loaded."""
    store = FileKeyStore(path, interval_s, clock)
    run(store.refresh(force=True))
    return store


def create_key(path: Path, key_id: str, tier: str = "standard", models: Sequence[str] = ("*",),
               **fields: Any) -> str:
    """A new key in the keys file at ``path``; its secret. No models means every model."""
    if not fields.get("limits"):
        fields.pop("limits", None)
    issued = run(KeyOps(FileKeyStore(path)).create(key_id, tier=tier, models=list(models) or ["*"],
                                                   **fields))
    return issued.secret


def rotate_key(path: Path, key_id: str) -> str:
    """The key's new secret (the old one stops once gateways reload)."""
    return run(KeyOps(FileKeyStore(path)).rotate(key_id)).secret


def revoke_key(path: Path, key_id: str) -> None:
    run(KeyOps(FileKeyStore(path)).revoke(key_id))
