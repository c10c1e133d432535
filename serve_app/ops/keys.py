"""``serve-app keys``: create, list, rotate and revoke API keys in the config's key store (the YAML
keys file by default; SQLite or Redis per ``gateway.keys.store``), through the same ``KeyOps`` as
the admin API (serve_app/gateway/keys/ops.py). The store is async; this command is the sync edge
that runs it (``asyncio.run``)."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from serve_app.config import GatewayConfig
from serve_app.gateway.keys.ops import KeyOps
from serve_app.ops.configfile import load_config
from serve_app.state.connections import Connections
from serve_app.state.keys import KeysFileError, open_key_store


def gateway_config(keys_file: str | None, config: str) -> GatewayConfig:
    """The config's gateway section, with ``keys_file`` if given: the store to open. A keys file
    given on the command line means that file, whatever the config's store."""
    gw = load_config(config).gateway
    if keys_file:
        keys = gw.keys.model_copy(update={"file": keys_file, "store": "file", "read_only": False})
        return gw.model_copy(update={"keys": keys})
    return gw


def run(command: str, gw: GatewayConfig, key_id: str = "", *, tier: str = "standard",
        models: str = "*", tenant: str | None = None, limits: dict[str, int] | None = None,
        **extra: Any) -> int:
    """Do ``command`` (create, rotate, list or revoke) on the store ``gw`` names and print the
    outcome; a new secret is printed once, as the last line. A store error is a message and exit
    code 2. ``extra`` holds create's other fields (role, expires_at, budget)."""
    return asyncio.run(_run(command, gw, key_id, tier=tier, models=models, tenant=tenant,
                            limits=limits, **extra))


async def _run(command: str, gw: GatewayConfig, key_id: str, *, tier: str, models: str,
               tenant: str | None, limits: dict[str, int] | None, **extra: Any) -> int:
    connections = Connections.of(gw.state)
    try:
        store = open_key_store(gw.keys, connections)
        ops = KeyOps(store)
        where = store.location
        if command == "create":
            model_list = [m for m in (models or "*").split(",") if m]
            issued = await ops.create(key_id, tier=tier, models=model_list, tenant=tenant,
                                      limits=limits or None, **extra)
            print(f"created key {key_id!r} (tier {tier}, models {','.join(model_list)}) in {where}")
            print("secret (shown once, store it now):")
            print(issued.secret)
        elif command == "rotate":
            issued = await ops.rotate(key_id)
            print(f"rotated key {key_id!r} in {where}; the old secret stops working within seconds")
            print("new secret (shown once, store it now):")
            print(issued.secret)
        elif command == "list":
            await _list(ops, where)
        elif command == "revoke":
            await ops.revoke(key_id)
            print(f"revoked key {key_id!r} in {where}")
    except KeysFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        await connections.close()
    return 0


async def _list(ops: KeyOps, where: str) -> None:
    keys = await ops.list()
    if not keys:
        print(f"no keys in {where}")
    for k in keys:
        state = "revoked" if k.revoked else "active"
        extra = f" limits={k.limits.model_dump(exclude_none=True)}" if k.limits else ""
        if k.role != "client":
            extra += f" role={k.role}"
        if k.expires_at:
            extra += f" expires_at={k.expires_at}"
        if k.budget:
            extra += f" budget={k.budget.tokens}/{k.budget.period}"
        print(f"{k.id:24} {k.tier:10} {state:8} {','.join(k.models):24} {k.created_at}{extra}")
