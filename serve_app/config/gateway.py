"""The ingress deployment (``gateway``): authentication, limits, timeouts and where state lives."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from serve_app.config.base import _Strict
from serve_app.config.batch import BatchConfig
from serve_app.config.keys import Budget

MAX_BODY_LIMIT = 32 * 1024 * 1024  # half the replica gRPC message limit (serve_app/local/front_door.py)


class GatewayConfig(_Strict):
    """The ingress deployment: authentication, limits, routing."""

    keys_file: str = "keys.yaml"
    keys_reload_interval_s: PositiveFloat = 1.0
    max_body_bytes: PositiveInt = Field(
        default=4 * 1024 * 1024,
        le=MAX_BODY_LIMIT,
        description="Largest request body. A body crosses to the model replica as one gRPC message "
        "(Ray Serve's throughput mode), whose limit serve-app sets to 64 MiB: so at most 32 MiB.",
    )
    request_timeout_s: PositiveFloat = 600.0
    stream_idle_timeout_s: PositiveFloat = Field(
        default=120.0,
        description="Longest silence allowed between two chunks of a stream before it is ended "
        "with an error.",
    )
    retry_after_s: PositiveInt = Field(
        default=2, description="The Retry-After of every 503 the gateway answers itself."
    )
    unavailable_hold_s: PositiveFloat = Field(
        default=5.0,
        description="Longest a request waits for its first answer from a model that lost its "
        "healthy replicas (all dead or restarting) before it is answered 503 with Retry-After.",
    )
    drain_timeout_s: PositiveFloat = Field(
        default=10.0,
        description="On a graceful stop (Ctrl-C, serve shutdown), how long in-flight streams may "
        "run on before they are ended with an error event.",
    )
    num_replicas: PositiveInt = 1
    max_ongoing_requests: PositiveInt = 1024
    num_cpus: float = Field(default=0.5, ge=0)
    serve_model: str | None = Field(
        default=None,
        description="Run this model's engine inside each gateway replica (the in-gateway path): "
        "its tokens go from the engine to the client in one process, with no Ray Serve hop and "
        "no relay (docs/PERFORMANCE.md). The gateway replicas then take the model's placement "
        "and are its replicas: the model needs a fixed deployment.num_replicas equal to "
        "gateway.num_replicas, and routing.affinity is not used for it (the front door balances "
        "over the gateway replicas). Other models are called through their deployments as "
        "before. None: every model is its own deployment.",
    )
    resources: dict[str, PositiveFloat] = Field(
        default_factory=dict,
        description="Custom Ray resources each gateway replica needs, to place it on given nodes.",
    )
    redis_url: str | None = Field(
        default=None,
        description="Shared limit counters for several gateway replicas, e.g. "
        "redis://127.0.0.1:6379/0.",
    )
    limits_store: Literal["auto", "memory", "redis"] = Field(
        default="auto",
        description="Where the RPM/TPM/concurrency counters live. auto: in the gateway's memory "
        "when it runs one replica (exact, and no round trip before each request: on a busy 2-core "
        "host a Redis call cost p50 7-12 ms, p95 150-260 ms), in Redis (redis_url) when it runs "
        "several; memory: each replica counts alone; redis: always shared (needs redis_url).",
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
    otlp_endpoint: str | None = Field(
        default=None,
        description="OTLP/HTTP traces endpoint (e.g. http://127.0.0.1:4318/v1/traces): each request's "
        "stages are exported as OpenTelemetry spans. Off when null.",
    )
    batch: BatchConfig = Field(
        default_factory=BatchConfig, description="OpenAI's Batch API (/v1/files, /v1/batches)."
    )
    keys_store: Literal["file", "sqlite", "redis"] = Field(
        default="file",
        description="Where keys live: the YAML keys_file, a SQLite database in state_dir (one "
        "host), or Redis at redis_url (a cluster). The admin API and `serve-app keys` use it.",
    )
    keys_read_only: bool = Field(
        default=False,
        description="Refuse key changes over the admin API (403), e.g. a keys file kept in Git.",
    )
    state_dir: str | None = Field(
        default=None,
        description="Where this host keeps durable state without Redis: keys.sqlite (keys_store "
        "sqlite), usage.sqlite (usage and budgets) and audit.log. `serve-app run` sets it.",
    )
    tenant_budgets: dict[str, Budget] = Field(
        default_factory=dict,
        description="Token budgets per tenant (the keys' tenant field), shared by its keys.",
    )
    audit_max_bytes: PositiveInt = Field(
        default=8 * 1024 * 1024,
        description="The audit log is rotated to audit.log.1 above this size (two files at most).",
    )

    @model_validator(mode="after")
    def _keys_store_has_its_place(self) -> GatewayConfig:
        if self.limits_store == "redis" and not self.redis_url:
            raise ValueError("limits_store ('redis') needs gateway.redis_url")
        if self.keys_store == "redis" and not self.redis_url:
            raise ValueError("keys_store ('redis') needs gateway.redis_url")
        if self.keys_store == "sqlite" and not self.state_dir:
            raise ValueError("keys_store ('sqlite') needs gateway.state_dir")
        return self

