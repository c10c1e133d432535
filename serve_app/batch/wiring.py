"""The Batch API's parts for one gateway replica, as ``gateway.deployment`` builds them."""

from __future__ import annotations

from serve_app.batch.batches import BatchStore
from serve_app.batch.routes import BatchService
from serve_app.batch.runner import BatchRunner, Handle, KeyLookup
from serve_app.config import AppConfig
from serve_app.metrics import BatchMetrics
from serve_app.state import State


def build(cfg: AppConfig, state: State, handle: Handle, keys: KeyLookup,
          replica: str) -> tuple[BatchService, BatchRunner]:
    """The routes' service and this replica's runner, over the state's file store and batches
    (Redis when ``gateway.state.redis_url`` is set, JSON files under the files folder otherwise)."""
    store = BatchStore(state.batches)
    runner = BatchRunner(cfg, state.files, store, handle, keys, BatchMetrics.create(replica))
    return BatchService(cfg, state.files, store), runner
