"""The Batch API's parts for one gateway replica, as ``gateway.deployment`` builds them."""

from __future__ import annotations

from pathlib import Path

from serve_app.batch.batches import BatchStore, FileBatchStore, RedisBatchStore
from serve_app.batch.files import FileStore
from serve_app.batch.routes import BatchService
from serve_app.batch.runner import BatchRunner, Handle, KeyLookup
from serve_app.config import AppConfig
from serve_app.metrics import BatchMetrics


def files_root(cfg: AppConfig) -> Path:
    """``gateway.batch.files_dir``, else a ``batch`` folder beside the keys file: the run's state
    folder (``.local/`` for the embedded default, next to its Redis state)."""
    configured = cfg.gateway.batch.files_dir
    if configured:
        return Path(configured).expanduser()
    return Path(cfg.gateway.keys_file).expanduser().resolve().parent / "batch"


def build(cfg: AppConfig, handle: Handle, keys: KeyLookup,
          replica: str) -> tuple[BatchService, BatchRunner]:
    """The routes' service and this replica's runner, over one file store and one state store
    (Redis when ``gateway.redis_url`` is set, JSON files under the files folder otherwise)."""
    root = files_root(cfg)
    files = FileStore(root)
    redis_url = cfg.gateway.redis_url
    store: BatchStore = RedisBatchStore(redis_url) if redis_url else FileBatchStore(root)
    runner = BatchRunner(cfg, files, store, handle, keys, BatchMetrics.create(replica))
    return BatchService(cfg, files, store), runner
