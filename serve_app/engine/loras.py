"""LoRA adapters added at run time, as one model replica serves them: loaded into vLLM's serving
layer on first use, and counted while requests use them.

A request for a run-time adapter carries its name and source (``RequestContext.adapter``;
``gateway.routing.adapters``). ``ensure`` loads it unless this replica already has it from that
source: the folder is checked as at start-up (``sources.resolve_adapter``: its config, its rank
against ``engine.max_lora_rank``), then vLLM's ``load_lora_adapter`` adds it to the engine. If
the same name comes with another source (removed, then added again from another folder), the old
one is unloaded once the requests using it have finished, then the new one loads under a new LoRA
id, so no prefix-cache block made with the old weights is reused. ``using`` counts a request
while it runs. An adapter removed through the admin API gets no more requests (the gateway
refuses them); vLLM's own LRU over ``max_cpu_loras`` frees its weights when others need room.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

from serve_app import errors
from serve_app.config import BUILTIN_ADAPTERS, AdapterConfig, ModelConfig
from serve_app.engine.sources import ModelSourceError, resolve_adapter
from serve_app.metrics import AdapterMetrics

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 30.0  # the longest a changed adapter waits for its requests before it is replaced
POLL_S = 0.05


class RuntimeLoras:
    """``models``: vLLM's ``OpenAIServingModels`` (its ``load_lora_adapter`` and
    ``unload_lora_adapter``); ``engine``: the AsyncLLM, whose ``remove_lora`` frees the weights."""

    def __init__(self, cfg: ModelConfig, cache_dir: str, models: Any, engine: Any,
                 metrics: AdapterMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.cache_dir = cache_dir
        self.models = models
        self.engine = engine
        self.loaded: dict[str, str] = {}  # name -> the source it was loaded from
        self.in_use: Counter[str] = Counter()
        self._locks: dict[str, asyncio.Lock] = {}

    def check(self, name: str, source: str) -> AdapterConfig:
        """The adapter as a config entry, or a 400 naming what is wrong with it."""
        try:
            adapter = AdapterConfig(name=name, source=source)
        except ValueError as exc:
            raise errors.InvalidRequest(f"adapter {name!r}: {exc}", param="source") from None
        base = BUILTIN_ADAPTERS.get(adapter.builtin or "")
        if base is not None and base != self.cfg.source:
            raise errors.InvalidRequest(f"adapter source ({source!r}) is made for {base!r}, not for "
                                        f"{self.cfg.id!r}", param="source")
        return adapter

    async def ensure(self, name: str, source: str) -> None:
        """Have ``name`` loaded from ``source``; raises a ``ServeAppError`` (400 for an adapter that
        cannot be loaded) with nothing changed."""
        if self.loaded.get(name) == source:
            return
        if name in {a.name for a in self.cfg.adapters} | {self.cfg.id, *self.cfg.aliases}:
            raise errors.InvalidRequest(f"{name!r} is already a name of model {self.cfg.id!r}",
                                        param="name")
        adapter = self.check(name, source)
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            if self.loaded.get(name) == source:
                return
            try:
                path = await asyncio.to_thread(resolve_adapter, adapter, self.cache_dir,
                                               self.cfg.engine.max_lora_rank)
            except ModelSourceError as exc:
                self._count(name, "refused")
                raise errors.InvalidRequest(str(exc), param="source") from None
            if name in self.loaded:
                await self._unload_when_idle(name)
                self._count(name, "replaced")
            from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

            result = await self.models.load_lora_adapter(
                LoadLoRAAdapterRequest(lora_name=name, lora_path=path), base_model_name=self.cfg.id)
            if not isinstance(result, str):  # vLLM's ErrorResponse
                self._count(name, "refused")
                err = result.error
                status = int(err.code) if 400 <= int(err.code) < 500 else 400
                raise errors.for_status(status)(f"adapter {name!r} could not be loaded: {err.message}",
                                                param="source")
            self.loaded[name] = source
            self._count(name, "loaded")
            logger.info("loaded run-time adapter %s for %s", name, self.cfg.id)

    def _count(self, name: str, result: str) -> None:
        if self.metrics is not None:
            self.metrics.load(adapter=name, result=result, loaded=len(self.loaded))

    async def _unload_when_idle(self, name: str) -> None:
        """Unload ``name`` once no request uses it (at most ``IDLE_WAIT_S``), and free its weights."""
        waited = 0.0
        while self.in_use[name] and waited < IDLE_WAIT_S:
            await asyncio.sleep(POLL_S)
            waited += POLL_S
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        old = self.models.lora_requests.get(name)
        await self.models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))
        if old is not None:
            await self.engine.remove_lora(old.lora_int_id)
        self.loaded.pop(name, None)

    @contextlib.contextmanager
    def using(self, name: str | None) -> Iterator[None]:
        """Count a request on ``name`` while it runs (none for the base model)."""
        if name is None:
            yield
            return
        self.in_use[name] += 1
        try:
            yield
        finally:
            self.in_use[name] -= 1
