"""LoRA adapters added at run time (``/admin/v1/adapters``): their records, and the table every
gateway replica keeps of them.

A run-time adapter is a model of its own, like a configured one (``models[].adapters``): a name,
its base model and a source (a PEFT folder on the model's nodes, or a builtin). It may be private
to one tenant (``tenant``): then only that tenant's keys reach it, and every other key gets the
404 of a model that does not exist. The records live in the state layer (``state.adapters``);
``RuntimeAdapters`` reads them all at start, every ``refresh_s`` and at once after this replica
changes them, and when a key asks for a name it does not know (``on_miss``), so an adapter added
through one gateway replica answers on every one as soon as the POST has answered.

Model replicas never read the store: each request for a run-time adapter carries its name and
source (``RequestContext.adapter``), and a replica that has not loaded it yet loads it before the
request (``engine.loras``). So a replica that restarts, or a new ``serve deploy``, serves the same
adapters, loading each on first use."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from serve_app.config.model import BUILTIN_PREFIX
from serve_app.state.adapters import AdapterDocs

logger = logging.getLogger("ray.serve")
REFRESH_S = 2.0
# A request that names an adapter this replica does not know yet reads the store again, at most this
# often: the adapter was just added on another gateway replica (its POST answered 201 there).
MISS_REFRESH_S = 0.25


@dataclass(frozen=True)
class RuntimeAdapter:
    name: str
    model: str  # the base model's id
    source: str  # a PEFT folder on the model's nodes, or builtin:<name>
    tenant: str | None = None  # private to this tenant's keys; None: any key whose models name it
    created_at: int = 0
    created_by: str = ""

    @property
    def label(self) -> str:
        """The model card's ``root``: a builtin's source, else the adapter's name (never a path)."""
        return self.source if self.source.startswith(BUILTIN_PREFIX) else self.name

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> RuntimeAdapter:
        doc: dict[str, Any] = json.loads(raw)
        return cls(**{k: doc[k] for k in cls.__dataclass_fields__ if k in doc})

    def public(self) -> dict[str, Any]:
        """What the admin API shows (the source included: it is the operator's own)."""
        return {"object": "adapter", **asdict(self)}


class RuntimeAdapters:
    """This gateway replica's copy of the run-time adapters, by name."""

    def __init__(self, store: AdapterDocs, refresh_s: float = REFRESH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.refresh_s = refresh_s
        self._clock = clock
        self._table: dict[str, RuntimeAdapter] = {}
        self._read_at = float("-inf")
        self._miss: asyncio.Future[None] | None = None

    def get(self, name: str) -> RuntimeAdapter | None:
        return self._table.get(name)

    def all(self) -> list[RuntimeAdapter]:
        return sorted(self._table.values(), key=lambda a: a.name)

    async def refresh(self, force: bool = False) -> None:
        """Read the store again if ``refresh_s`` has passed (or ``force``); a record that cannot be
        read is skipped with a warning, never the others."""
        if not force and self._clock() - self._read_at < self.refresh_s:
            return
        raw = await self.store.all()
        table: dict[str, RuntimeAdapter] = {}
        for name, doc in raw.items():
            try:
                table[name] = RuntimeAdapter.from_json(doc)
            except (ValueError, TypeError) as exc:
                logger.warning("run-time adapter %r not read: %s", name, exc.__class__.__name__)
        self._table = table  # one assignment: readers see the old table or the new one
        self._read_at = self._clock()

    async def on_miss(self, name: str) -> None:
        """``name`` was asked for and is not in the table: read the store again, no sooner than
        ``MISS_REFRESH_S`` after the last read (so a request may wait that long), and once for every
        miss that comes meanwhile: unknown names cost at most one read per interval. A store that
        does not answer leaves the table as it was."""
        if name in self._table:
            return
        if self._miss is None or self._miss.done():
            self._miss = asyncio.ensure_future(self._read_after_miss())
        await asyncio.shield(self._miss)

    async def _read_after_miss(self) -> None:
        wait = MISS_REFRESH_S - (self._clock() - self._read_at)
        if wait > 0:
            await asyncio.sleep(wait)
        try:
            await self.refresh(force=True)
        except Exception as exc:
            logger.warning("run-time adapters not read on a miss: %s", exc.__class__.__name__)

    async def keep_fresh(self) -> None:
        """Refresh every ``refresh_s`` until cancelled (a replica's background task); a store that
        does not answer keeps the last table."""
        while True:
            try:
                await self.refresh(force=True)
            except Exception as exc:  # Redis away for a moment: the last table still serves
                logger.warning("run-time adapters not refreshed: %s", exc.__class__.__name__)
            await asyncio.sleep(self.refresh_s)
