"""Resolve a request's ``model`` (id, alias, route or adapter) to a model deployment the key may use.

An adapter's name resolves to its base model's deployment; the body keeps the adapter's name, so
that vLLM's serving layer applies the adapter there. A key reaches an adapter only if its
``models`` name the adapter (or ``*``): access to the base model is not access to a fine-tune.
Adapters added at run time (``routing.adapters``) resolve the same way, after every configured
name; one private to a tenant is reached by that tenant's keys only."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from serve_app.config import AppConfig, KeyRecord
from serve_app.errors import InvalidRequest, ModelNotFound
from serve_app.gateway.routing.adapters import RuntimeAdapter, RuntimeAdapters


@dataclass(frozen=True)
class Route:
    name: str  # what the client asked for
    model_id: str  # the first (or only) model behind it
    task: str
    # Weighted targets for a split route; empty for a plain model id or alias.
    split: tuple[tuple[str, int], ...] = ()
    # For a LoRA adapter's name: its source's label (the model card's root); None otherwise.
    adapter_root: str | None = None
    # For an adapter added at run time: its record (its source travels to the replica).
    runtime: RuntimeAdapter | None = None
    _rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def pick(self) -> str:
        """The model deployment for this request (weighted choice on a split route)."""
        if not self.split:
            return self.model_id
        ids = [m for m, _ in self.split]
        return self._rng.choices(ids, weights=[w for _, w in self.split])[0]


class Router:
    """Maps every public model name to its model; answers 404 alike for unknown and forbidden."""

    def __init__(self, cfg: AppConfig, runtime: RuntimeAdapters | None = None) -> None:
        self._routes: dict[str, Route] = {}
        self.runtime = runtime
        tasks = {m.id: m.task for m in cfg.models}
        self._tasks = tasks
        self._fallback = {m.id: m.fallback for m in cfg.models}
        for m in cfg.models:
            for name in (m.id, *m.aliases):
                self._routes[name] = Route(name=name, model_id=m.id, task=m.task)
        for m in cfg.models:
            for a in m.adapters:
                self._routes[a.name] = Route(name=a.name, model_id=m.id, task=m.task,
                                             adapter_root=a.label)
        for r in cfg.routes:
            split = tuple((t.model, t.weight) for t in r.split)
            self._routes[r.name] = Route(
                name=r.name, model_id=split[0][0], task=tasks[split[0][0]], split=split
            )

    def fallback(self, route: Route, model_id: str) -> str | None:
        """The model that answers for ``model_id`` when it cannot; none for an adapter, which
        only its own base model serves."""
        return None if route.adapter_root is not None else self._fallback.get(model_id)

    def taken(self, name: str) -> bool:
        """Whether ``name`` is a configured model id, alias, route or adapter."""
        return name in self._routes

    def _runtime_route(self, name: str) -> Route | None:
        a = self.runtime.get(name) if self.runtime is not None else None
        if a is None or a.model not in self._tasks:  # its base model left the config
            return None
        return Route(name=a.name, model_id=a.model, task=self._tasks[a.model], adapter_root=a.label,
                     runtime=a)

    def _visible(self, route: Route, key: KeyRecord) -> bool:
        if route.runtime is not None and route.runtime.tenant is not None \
                and key.tenant != route.runtime.tenant:
            return False
        if route.adapter_root is not None:
            return key.allows(route.name)
        return key.allows(route.name) or key.allows(route.model_id)

    async def refresh_for(self, name: Any, key: KeyRecord) -> None:
        """Before ``resolve``: a name the key may use that is no configured model nor a known
        run-time adapter makes the adapter table read the store again (``RuntimeAdapters.on_miss``):
        it may have been added through another gateway replica a moment ago."""
        if self.runtime is not None and isinstance(name, str) and name \
                and name not in self._routes and key.allows(name):
            await self.runtime.on_miss(name)

    def resolve(self, name: Any, key: KeyRecord) -> Route:
        if name is None:
            raise InvalidRequest("you must provide a model parameter", param="model")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("model must be a non-empty string", param="model")
        route = self._routes.get(name) or self._runtime_route(name)
        if route is None or not self._visible(route, key):
            shown = name if len(name) <= 128 else name[:128] + "..."
            raise ModelNotFound(
                f"The model `{shown}` does not exist or you do not have access to it.",
                param="model",
            )
        return route

    def visible(self, key: KeyRecord) -> list[Route]:
        runtime = [r for a in (self.runtime.all() if self.runtime is not None else [])
                   if a.name not in self._routes and (r := self._runtime_route(a.name)) is not None]
        return [r for r in [*self._routes.values(), *runtime] if self._visible(r, key)]
