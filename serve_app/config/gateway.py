"""The ingress deployment (``gateway``): the deployment itself, and one section per package of the
gateway: ``http``, ``keys``, ``state``, ``accounting``, ``batch``, ``responses`` and ``console``."""

from __future__ import annotations

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from serve_app.config.accounting import AccountingConfig
from serve_app.config.base import _Strict
from serve_app.config.batch import BatchConfig
from serve_app.config.console import ConsoleConfig
from serve_app.config.http import HttpConfig
from serve_app.config.keys import KeysConfig
from serve_app.config.responses import ResponsesConfig
from serve_app.config.state import StateConfig


class GatewayConfig(_Strict):
    """The ingress deployment: its replicas and placement here, the rest in its sections."""

    num_replicas: PositiveInt = 1
    max_ongoing_requests: PositiveInt = 1024
    num_cpus: float = Field(default=0.5, ge=0)
    resources: dict[str, PositiveFloat] = Field(
        default_factory=dict,
        description="Custom Ray resources each gateway replica needs, to place it on given nodes.",
    )
    max_surge_percent: int = Field(
        default=0, ge=0, le=100,
        description="Ray Serve's surge during a rolling update of the gateway (see the model "
        "deployment's field of the same name).",
    )
    replicas_refresh_s: PositiveFloat = Field(
        default=2.0,
        description="How often each gateway replica reads Ray Serve's status (its one reader): the "
        "running replicas of every model, which admission capacity, tier shedding and the outage "
        "hold follow, and whether the app is being deleted (the drain).",
    )
    front_end_niceness: int | None = Field(
        default=0, ge=-20, le=19,
        description="CPU niceness for every thread of the gateway replicas and of Ray Serve's "
        "HAProxy (Ray starts its workers at 15, behind busy-waiting engines); null leaves Ray's. "
        "Lowering it needs root (CAP_SYS_NICE); without it the gateway logs one warning.",
    )
    http: HttpConfig = Field(
        default_factory=HttpConfig,
        description="Request bodies, timeouts, the gateway's own 503s and the drain.",
    )
    keys: KeysConfig = Field(
        default_factory=KeysConfig, description="Where the API keys live."
    )
    state: StateConfig = Field(
        default_factory=StateConfig,
        description="Shared (Redis) and durable (state folder) state, and the limit counters.",
    )
    accounting: AccountingConfig = Field(
        default_factory=AccountingConfig,
        description="Traces, the audit log and the tenants' token budgets.",
    )
    batch: BatchConfig = Field(
        default_factory=BatchConfig, description="OpenAI's Batch API (/v1/files, /v1/batches)."
    )
    responses: ResponsesConfig = Field(
        default_factory=ResponsesConfig,
        description="Stored Responses (store, previous_response_id, background).",
    )
    console: ConsoleConfig = Field(
        default_factory=ConsoleConfig, description="The operator's console at /console."
    )

    @model_validator(mode="after")
    def _stores_have_their_place(self) -> GatewayConfig:
        # Across sections: the keys and the limit counters name a store; the state section
        # says whether that store's place exists.
        state, keys = self.state, self.keys
        if state.limits_store == "redis" and not state.redis_url:
            raise ValueError("gateway.state.limits_store ('redis') needs gateway.state.redis_url")
        if keys.store == "redis" and not state.redis_url:
            raise ValueError("gateway.keys.store ('redis') needs gateway.state.redis_url")
        if keys.store == "sqlite" and not state.dir:
            raise ValueError("gateway.keys.store ('sqlite') needs gateway.state.dir")
        return self
