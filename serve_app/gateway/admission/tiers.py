"""Tier policy: which tier a key is in, the limits that hold for it, and its max-token cap.

A key names its tier (an unknown one falls back to ``default_tier``); the tier's ``key_limits``
hold for each of its keys, overridden field by field by the key's own. A request's completion is
bounded by the endpoint's max-token field (``Endpoint.max_tokens_fields``); the tier's cap is
written into the body when the request asks for more, or for nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from serve_app import errors
from serve_app.config import AppConfig, KeyRecord, Limits, TierConfig
from serve_app.protocol import requested_max_tokens

DEFAULT_RESERVE_TOKENS = 1024  # reserved for a request that names no bound and has no cap


@dataclass(frozen=True)
class Budget:
    """The completion tokens to reserve for a request, and the body field that bounds them
    (None for an endpoint that generates no text), named when the reservation is refused."""

    tokens: int
    field: str | None


class TierPolicy:
    """The configured tiers, read per key."""

    def __init__(self, cfg: AppConfig) -> None:
        self.cfg = cfg

    def name(self, key: KeyRecord) -> str:
        """The tier that holds for ``key``: its own, or ``default_tier`` for a name not configured."""
        return key.tier if key.tier in self.cfg.tiers else self.cfg.default_tier

    def tier(self, key: KeyRecord) -> TierConfig:
        return self.cfg.tiers[self.name(key)]

    def key_limits(self, key: KeyRecord) -> Limits:
        return self.tier(key).key_limits.merged(key.limits)

    def max_tokens_cap(self, key: KeyRecord) -> int | None:
        """The most completion tokens a request of ``key`` gets: its own cap, else its tier's."""
        return self.key_limits(key).max_tokens_cap or self.tier(key).limits.max_tokens_cap

    def clamp_max_tokens(self, body: dict[str, Any], key: KeyRecord, fields: Sequence[str]) -> Budget:
        """Apply the tier's cap to the first of ``fields`` the body sets (else to the first of
        ``fields``); return the completion tokens to reserve."""
        cap = self.max_tokens_cap(key)
        name, value = requested_max_tokens(body, fields)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise errors.InvalidRequest(f"{name} must be a positive integer", param=name)
        field = name or (fields[0] if fields else None)
        if cap is not None and (value is None or value > cap):
            if field is not None:
                body[field] = cap
            return Budget(cap, field)
        return Budget(value if value is not None else DEFAULT_RESERVE_TOKENS, field)
