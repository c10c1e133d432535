"""The model listing (``GET /v1/models``, ``GET /v1/models/{id}``): what clients size their requests by.

OpenAI's cards (vLLM's fields: id, object, created, owned_by, root, parent) also carry what the
gateway knows of the model and of the calling key, so that a client need not guess its context:
vLLM's ``max_model_len`` (the model's ``engine.max_model_len``; None when unset, as then only the
engine knows it), the most output tokens a request of this key gets (``max_output_tokens``: the
key's tier cap, within the context), the modalities, whether tools are served (a generate model
with a ``tool_call_parser``) and the key's limits. A request with an ``anthropic-version`` header
(Claude Code, the anthropic SDK) gets Anthropic's shape of the listing, paged as Anthropic pages it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from serve_app import errors
from serve_app.config import AppConfig, KeyRecord, ModelConfig
from serve_app.gateway.admission.tiers import TierPolicy
from serve_app.gateway.routing.router import Route

ANTHROPIC_PAGE = 20  # Anthropic's default page size for its model listing


class ModelCards:
    """The cards of the models a key may see, in either dialect."""

    def __init__(self, cfg: AppConfig, tiers: TierPolicy, created: int) -> None:
        self._models = {m.id: m for m in cfg.models}
        self._tiers = tiers
        self._created = created  # when the app was built: the same on every gateway replica

    def card(self, route: Route, key: KeyRecord) -> dict[str, Any]:
        """OpenAI's model object, with the model's limits and the key's."""
        m = self._models[route.model_id]
        generates = m.task == "generate"
        return {
            "id": route.name,
            "object": "model",
            "created": self._created,
            "owned_by": "serve-app",
            # As vLLM's cards: an adapter's parent is its base model and its root its source
            # (a label, never a server path); an alias's root and parent are the model's id.
            "root": route.adapter_root or route.model_id,
            "parent": None if route.name == route.model_id else route.model_id,
            "max_model_len": m.engine.max_model_len,
            "max_output_tokens": self._max_output(m, key) if generates else None,
            "modalities": {"input": ["text"], "output": ["text" if generates else "embeddings"]},
            "supports_tools": generates and bool(m.frontend.get("tool_call_parser")),
            "limits": {"tier": self._tiers.name(key),
                       **self._tiers.key_limits(key).model_dump(exclude={"max_tokens_cap"}),
                       "max_tokens_cap": self._tiers.max_tokens_cap(key)},
        }

    def _max_output(self, m: ModelConfig, key: KeyRecord) -> int | None:
        """The tier's cap and the context, whichever is smaller; None when neither is known."""
        known = [n for n in (self._tiers.max_tokens_cap(key), m.engine.max_model_len) if n]
        return min(known) if known else None

    def listing(self, routes: list[Route], key: KeyRecord, limit: int | None) -> dict[str, Any]:
        """OpenAI's list object: the first ``limit`` cards (all of them without one)."""
        cards = [self.card(r, key) for r in routes]
        return {"object": "list", "data": cards[:limit] if limit else cards}

    def anthropic_card(self, route: Route) -> dict[str, Any]:
        """Anthropic's model object (its fields are these four)."""
        created = datetime.fromtimestamp(self._created, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {"type": "model", "id": route.name, "display_name": route.name,
                "created_at": created}

    def anthropic_listing(self, routes: list[Route], limit: int | None,
                          after_id: str | None) -> dict[str, Any]:
        """Anthropic's page: ``limit`` models (20 by default) after ``after_id``, and whether
        more follow (a client pages on with the page's ``last_id``)."""
        names = [r.name for r in routes]
        start = 0
        if after_id is not None:
            if after_id not in names:
                raise errors.InvalidRequest(f"after_id {after_id[:128]!r} names no model listed",
                                            param="after_id")
            start = names.index(after_id) + 1
        page = routes[start:start + (limit or ANTHROPIC_PAGE)]
        data = [self.anthropic_card(r) for r in page]
        return {"data": data, "has_more": start + len(page) < len(routes),
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None}
