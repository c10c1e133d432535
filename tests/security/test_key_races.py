"""A rotation can never undo a revocation (issue 36). Two replicas (or the CLI and a replica)
each hold a store on one backing (the YAML file, SQLite, Redis); one rotates a key and, while it
is between reading the key and writing it back, the other revokes it. The key must end revoked:
either the revocation lands after the rotation, or the rotation sees the revoked key and refuses.

The window is widened on purpose: the new secret's digest is computed slowly, which the old
rotate did between its read and its write."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from serve_app.gateway.keys import ops as ops_module
from serve_app.gateway.keys.ops import KeyOps
from serve_app.state.keys import KeyNotFound, digest
from tests.unit.fakes import StepClock
from tests.unit.test_keystore import KINDS, _open


@pytest.mark.parametrize("kind", KINDS)
def test_a_revocation_during_a_rotation_stands(kind: str, tmp_path: Path,
                                               request: pytest.FixtureRequest,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = f"test:keys:{uuid.uuid4().hex}"
    rotating = threading.Event()

    def slow_digest(secret: str) -> str:
        rotating.set()
        time.sleep(0.4)
        return digest(secret)

    async def create() -> None:
        async with _open(kind, tmp_path, request, StepClock(), prefix=prefix) as store:
            await KeyOps(store).create("team-a")

    async def rotate(out: dict[str, Any]) -> None:
        async with _open(kind, tmp_path, request, StepClock(), prefix=prefix) as store:
            try:
                await KeyOps(store).rotate("team-a")
                out["rotate"] = "done"
            except KeyNotFound:
                out["rotate"] = "refused"

    async def revoke() -> bool:
        async with _open(kind, tmp_path, request, StepClock(), prefix=prefix) as store:
            await asyncio.to_thread(rotating.wait, 5)
            await asyncio.sleep(0.05)  # the rotation is between its read and its write
            await KeyOps(store).revoke("team-a")
            return (await KeyOps(store).get("team-a")).revoked

    async def final() -> bool:
        async with _open(kind, tmp_path, request, StepClock(), prefix=prefix) as store:
            return (await KeyOps(store).get("team-a")).revoked

    asyncio.run(create())
    monkeypatch.setattr(ops_module, "digest", slow_digest)
    out: dict[str, Any] = {}
    rotator = threading.Thread(target=lambda: asyncio.run(rotate(out)))
    rotator.start()
    assert asyncio.run(revoke())
    rotator.join(10)
    assert out["rotate"] in ("done", "refused")
    assert asyncio.run(final()), f"the rotation ({out['rotate']}) undid the revocation"
