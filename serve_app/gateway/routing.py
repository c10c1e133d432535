"""Resolve a request's ``model`` (id or alias) to a model deployment the key may use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serve_app.config import AppConfig, KeyRecord
from serve_app.errors import InvalidRequest, ModelNotFound


@dataclass(frozen=True)
class Route:
    name: str  # what the client asked for
    model_id: str  # the deployment that serves it
    task: str


class Router:
    """Maps every public model name to its model; answers 404 alike for unknown and forbidden."""

    def __init__(self, cfg: AppConfig) -> None:
        self._routes: dict[str, Route] = {}
        for m in cfg.models:
            for name in (m.id, *m.aliases):
                self._routes[name] = Route(name=name, model_id=m.id, task=m.task)

    def _visible(self, route: Route, key: KeyRecord) -> bool:
        return key.allows(route.name) or key.allows(route.model_id)

    def resolve(self, name: Any, key: KeyRecord) -> Route:
        if name is None:
            raise InvalidRequest("you must provide a model parameter", param="model")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("model must be a non-empty string", param="model")
        route = self._routes.get(name)
        if route is None or not self._visible(route, key):
            shown = name if len(name) <= 128 else name[:128] + "..."
            raise ModelNotFound(
                f"The model `{shown}` does not exist or you do not have access to it.",
                param="model",
            )
        return route

    def visible(self, key: KeyRecord) -> list[Route]:
        return [r for r in self._routes.values() if self._visible(r, key)]
