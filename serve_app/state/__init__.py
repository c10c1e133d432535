"""The state layer: ``open_state(cfg)`` opens every connection (``connections``) and the typed
stores built on them. Nothing else under ``serve_app`` builds a Redis client or a SQLite connection."""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.config import AppConfig
from serve_app.state.adapters import (
    ADAPTERS_FILE,
    AdapterDocs,
    MemoryAdapterStore,
    RedisAdapterStore,
    SqliteAdapterStore,
)
from serve_app.state.audit import AUDIT_FILE, AuditFile
from serve_app.state.batches import BatchDocs, FileBatchStore, RedisBatchStore
from serve_app.state.budgets import BudgetBackend, MemoryBudgets, RedisBudgets, SqliteBudgets
from serve_app.state.connections import Connections
from serve_app.state.files import FileStore, files_root
from serve_app.state.keys import KeyStore, open_key_store
from serve_app.state.limits import LimitBackend, open_limits
from serve_app.state.responses import (
    RESPONSES_FILE,
    MemoryResponseStore,
    RedisResponseStore,
    ResponseDocs,
    SqliteResponseStore,
)
from serve_app.state.secrets import shared_secret
from serve_app.state.usage import (
    USAGE_FILE,
    MemoryUsageStore,
    RedisUsageStore,
    SqliteUsageStore,
    UsageStore,
)


@dataclass
class State:
    """One process's connections and the stores on them; ``close`` gives the connections back
    (the stores own none of their own)."""

    connections: Connections
    usage: UsageStore
    budgets: BudgetBackend
    limits: LimitBackend
    batches: BatchDocs
    responses: ResponseDocs
    adapters: AdapterDocs
    files: FileStore
    audit: AuditFile | None  # None without gateway.state.dir: audit events are only counted
    keys: KeyStore

    async def shared_secret(self, name: str) -> bytes | None:
        """A secret all replicas share, made once (``secrets.shared_secret``); None without Redis
        or a state dir."""
        return await shared_secret(self.connections, name)

    async def close(self) -> None:
        """At the replica's stop; safe to call twice."""
        await self.connections.close()


def open_state(cfg: AppConfig) -> State:
    """The stores ``cfg`` asks for. Usage and budgets: Redis when replicas share one
    (``gateway.state.redis_url``), else SQLite in ``gateway.state.dir`` (one file, one connection,
    for both), else memory. Limits: by ``gateway.state.limits_store`` (``state/limits.py``).
    Batches: Redis, else JSON files under the files folder, where the files always are
    (``files_root``). Stored responses and run-time LoRA adapters: Redis, else ``responses.sqlite``
    and ``adapters.sqlite`` in the state folder, else memory. The audit trail: ``<gateway.state.dir>/audit.log``. Keys: by
    ``gateway.keys.store``, not yet loaded (``await state.keys.refresh(force=True)``)."""
    gw = cfg.gateway
    connections = Connections.of(gw.state)
    state_dir = connections.state_dir
    usage: UsageStore
    budgets: BudgetBackend
    if gw.state.redis_url:
        usage, budgets = RedisUsageStore(connections.redis()), RedisBudgets(connections.redis())
    elif state_dir:  # durable on one host without Redis
        usage_file = connections.sqlite(USAGE_FILE)
        usage, budgets = SqliteUsageStore(usage_file), SqliteBudgets(usage_file)
    else:
        usage, budgets = MemoryUsageStore(), MemoryBudgets()
    root = files_root(cfg)
    batches: BatchDocs = (RedisBatchStore(connections.redis()) if gw.state.redis_url
                          else FileBatchStore(root))
    responses: ResponseDocs
    if gw.state.redis_url:
        responses = RedisResponseStore(connections.redis())
    elif state_dir:
        responses = SqliteResponseStore(connections.sqlite(RESPONSES_FILE))
    else:
        responses = MemoryResponseStore()
    adapters: AdapterDocs
    if gw.state.redis_url:
        adapters = RedisAdapterStore(connections.redis())
    elif state_dir:
        adapters = SqliteAdapterStore(connections.sqlite(ADAPTERS_FILE))
    else:
        adapters = MemoryAdapterStore()
    audit = AuditFile(state_dir / AUDIT_FILE, gw.accounting.audit_max_bytes) if state_dir else None
    return State(connections=connections, usage=usage, budgets=budgets,
                 limits=open_limits(gw, connections), batches=batches, responses=responses,
                 adapters=adapters,
                 files=FileStore(root),
                 audit=audit, keys=open_key_store(gw.keys, connections))
