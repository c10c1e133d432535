"""API keys: where the gateway keeps them (``gateway.keys``), the records as stored (the keys file,
or the SQLite/Redis key stores) and token budgets."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, field_validator, model_validator

from serve_app.config.base import _Strict
from serve_app.config.tiers import Limits


def expiry_time(value: str) -> float:
    """An ``expires_at`` as epoch seconds (UTC when it has no offset); ValueError names the value."""
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"expires_at ({value!r}) is not an ISO 8601 time") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.timestamp()


class Budget(_Strict):
    """A token budget: prompt + completion tokens per calendar day or month (UTC)."""

    tokens: PositiveInt = Field(le=10**15, description="Prompt + completion tokens allowed per period.")
    period: Literal["day", "month"] = "month"


class KeyRecord(_Strict):
    """One API key as stored: never the secret, only its SHA-256 digest."""

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    tier: str = "standard"
    models: tuple[str, ...] = Field(
        default=("*",), description='Model ids or aliases this key may use; "*" means every model.'
    )
    created_at: str = ""
    revoked: bool = False
    tenant: str | None = Field(
        default=None,
        description="Keys that share a tenant share vLLM's prefix cache; by default each key is "
        "its own tenant.",
    )
    limits: Limits | None = Field(
        default=None, description="Overrides the tier's key_limits field by field."
    )
    role: Literal["client", "admin"] = Field(
        default="client",
        description="client keys call the model routes; admin keys only the admin API "
        "(/admin/v1), and each is refused (403) on the other's routes.",
    )
    expires_at: str | None = Field(
        default=None,
        description="ISO 8601 time (UTC when it has no offset) after which the key gets 401.",
    )
    budget: Budget | None = Field(
        default=None, description="Tokens this key may use per day or month (429 insufficient_quota)."
    )

    @field_validator("expires_at")
    @classmethod
    def _expiry_is_a_time(cls, v: str | None) -> str | None:
        if v is not None:
            expiry_time(v)
        return v

    def expired(self, now: float) -> bool:
        """Whether the key's ``expires_at`` (if any) is at or before ``now`` (epoch seconds)."""
        return self.expires_at is not None and expiry_time(self.expires_at) <= now

    @property
    def tenant_id(self) -> str:
        """The tenant's name, or the key's id for a key of no tenant: who is served fairly
        (the flow queue) and reported (usage by tenant)."""
        return self.tenant or self.id

    @property
    def owner(self) -> str:
        """Who owns what this key makes and reads (files, batches) and whose prefix cache it
        shares: ``tenant:<name>``, or ``key:<id>`` for a key of no tenant. Tenants and keys never
        share a name space, so a key whose id is another key's tenant name reads nothing of it."""
        return f"tenant:{self.tenant}" if self.tenant else f"key:{self.id}"

    def allows(self, model_id: str) -> bool:
        return "*" in self.models or model_id in self.models


class KeysFile(_Strict):
    """The keys file: a YAML document ``{keys: [...]}``."""

    keys: tuple[KeyRecord, ...] = ()

    @model_validator(mode="after")
    def _unique(self) -> KeysFile:
        ids: set[str] = set()
        for k in self.keys:
            if k.id in ids:
                raise ValueError(f"key id ({k.id!r}) appears twice")
            ids.add(k.id)
        return self



class KeysConfig(_Strict):
    """Where the gateway's keys live (``serve_app/gateway/keys``; the stores are opened with the
    rest of the state). The admin API and `serve-app keys` use the same store."""

    file: str = "keys.yaml"
    reload_interval_s: PositiveFloat = 1.0
    store: Literal["file", "sqlite", "redis"] = Field(
        default="file",
        description="Where keys live: the YAML gateway.keys.file, a SQLite database in "
        "gateway.state.dir (one host), or Redis at gateway.state.redis_url (a cluster). The admin "
        "API and `serve-app keys` use it.",
    )
    read_only: bool = Field(
        default=False,
        description="Refuse key changes over the admin API (403), e.g. a keys file kept in Git.",
    )
