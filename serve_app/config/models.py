"""The app's configuration schema.

A Ray Serve config file (``configs/*.yaml``) names ``serve_app.app:build_app`` as its import path;
its ``args`` block is validated here by ``AppConfig``. Every model forbids unknown fields, so a
typo fails at deploy time with the field's name instead of being silently ignored.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

_ID_RE = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"
# The Ray Serve application's name: `serve-app run` deploys under it, the configs' applications
# are named it, and the tools that find the app's deployments (diagnose, tests, load tools) use it.
APP_NAME = "llm"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineArgs(_Strict):
    """The vLLM engine arguments we type and check. ``extra`` passes anything else through as-is."""

    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    tensor_parallel_size: PositiveInt = 1
    pipeline_parallel_size: PositiveInt = 1
    max_model_len: PositiveInt | None = None
    max_num_seqs: PositiveInt | None = None
    max_num_batched_tokens: PositiveInt | None = None
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    kv_cache_memory_bytes: PositiveInt | None = None
    block_size: PositiveInt | None = None
    enable_prefix_caching: bool | None = None
    enforce_eager: bool = False
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    distributed_executor_backend: Literal["mp", "ray"] | None = None
    quantization: str | None = None
    seed: int | None = 0
    trust_remote_code: bool = False
    extra: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _extra_does_not_shadow(self) -> EngineArgs:
        typed = set(type(self).model_fields) - {"extra"}
        clash = sorted(typed & set(self.extra))
        if clash:
            raise ValueError(f"extra ({clash}) repeats typed engine fields; set them directly")
        return self


class ObjectivePolicyConfig(_Strict):
    """Autoscaling on the top tier's TTFT objective (``serve_app.engine.autoscale``) rather than on
    ongoing requests alone. Each threshold is a fraction of the top-priority tier's
    ``objectives.ttft_p95_ms``; the p95s are over each replica's last ``window_s``."""

    up_at: float = Field(
        default=0.8, gt=0.0, le=1.0,
        description="Add a replica once the top tier's TTFT p95 reaches this fraction of its "
        "objective (held for upscale_delay_s).",
    )
    wait_up_at: float = Field(
        default=0.5, gt=0.0, le=1.0,
        description="Or once its wait before the engine starts it (the gateway's queue and Ray "
        "Serve's) reaches this fraction of the objective, or keeps rising past half of it.",
    )
    down_at: float = Field(
        default=0.5, gt=0.0, lt=1.0,
        description="Remove a replica only while the TTFT p95 and the wait stay under this "
        "fraction (for downscale_delay_s), and the ongoing requests fit one replica fewer below "
        "the load that last made the tier miss (hysteresis).",
    )
    window_s: PositiveFloat = Field(
        default=30.0,
        description="Each replica's p95s cover the requests of this many seconds; after a change "
        "of replicas the policy waits this long, so the p95s describe the new count.",
    )
    min_samples: PositiveInt = Field(
        default=10,
        description="Top-tier requests a replica needs in its window for its p95 to count.",
    )

    @model_validator(mode="after")
    def _down_below_up(self) -> ObjectivePolicyConfig:
        if self.down_at >= self.up_at:
            raise ValueError(f"down_at ({self.down_at}) must be < up_at ({self.up_at})")
        return self


class AutoscalingConfig(_Strict):
    """The subset of Ray Serve's autoscaling config we expose, with its own rules checked early."""

    min_replicas: NonNegativeInt = 1
    max_replicas: PositiveInt = 1
    initial_replicas: NonNegativeInt | None = None
    target_ongoing_requests: PositiveFloat = 16.0
    upscale_delay_s: float = Field(default=30.0, ge=0)
    downscale_delay_s: float = Field(default=600.0, ge=0)
    metrics_interval_s: PositiveFloat = 10.0
    look_back_period_s: PositiveFloat = 30.0
    objective_policy: ObjectivePolicyConfig | None = Field(
        default=None,
        description="Scale on the top tier's TTFT and wait against its objective "
        "(serve_app/engine/autoscale.py); upscale_delay_s and downscale_delay_s become its holds. "
        "None keeps Ray Serve's policy on target_ongoing_requests.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})"
            )
        if self.initial_replicas is not None and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError(
                f"initial_replicas ({self.initial_replicas}) must be between min_replicas "
                f"({self.min_replicas}) and max_replicas ({self.max_replicas})"
            )
        return self


class DeploymentOptions(_Strict):
    """Ray Serve deployment options for one model. Give ``num_replicas`` or ``autoscaling_config``."""

    num_replicas: PositiveInt | None = None
    autoscaling_config: AutoscalingConfig | None = None
    max_ongoing_requests: PositiveInt = 64
    max_queued_requests: int = Field(default=-1, ge=-1)
    health_check_period_s: PositiveFloat = 10.0
    health_check_timeout_s: PositiveFloat = 30.0
    graceful_shutdown_timeout_s: float = Field(
        default=20.0, ge=0,
        description="How long a stopping replica may finish its in-flight requests (streams): "
        "make it longer than the longest stream, so scale-down and updates fail nothing.",
    )
    max_surge_percent: int = Field(
        default=0, ge=0, le=100,
        description="Ray Serve's surge during a rolling update, as a share of the replica count: "
        "with 100, each replacement starts before the old replica stops, so a one-replica model "
        "keeps serving through a config change (it needs room for one more replica).",
    )

    @field_validator("max_queued_requests")
    @classmethod
    def _queue_limit(cls, v: int) -> int:
        if v == 0:
            raise ValueError("max_queued_requests (0) must be -1 (no limit) or a positive integer")
        return v

    @property
    def replicas(self) -> int:
        """Replicas when not autoscaling (Ray Serve's default is one)."""
        return self.num_replicas or 1

    @property
    def most_replicas(self) -> int:
        """Replicas at the deployment's largest (``max_replicas`` when autoscaling)."""
        return self.autoscaling_config.max_replicas if self.autoscaling_config else self.replicas

    @property
    def capacity(self) -> int | None:
        """Requests the deployment holds at most (at its largest), running or queued; None if unbounded."""
        return self.capacity_with(self.most_replicas)

    def capacity_with(self, running: int) -> int | None:
        """Requests the deployment holds with ``running`` replicas (at most ``most_replicas``)
        running, queued included; None if unbounded."""
        if self.max_queued_requests == -1:
            return None
        return self.max_ongoing_requests * min(running, self.most_replicas) + self.max_queued_requests

    @model_validator(mode="after")
    def _one_scaling_mode(self) -> DeploymentOptions:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError(
                f"num_replicas ({self.num_replicas}) and autoscaling_config are exclusive; give one"
            )
        return self


class Accelerator(_Strict):
    """Where a model runs. ``kind`` decides the placement-group bundles."""

    kind: Literal["cpu", "gpu"] = "cpu"
    type: str | None = Field(
        default=None,
        description='A Ray accelerator type such as "A10G" or "H100"; None means any GPU.',
    )
    cpus_per_worker: PositiveFloat = Field(
        default=1.0, description="CPUs reserved for each engine worker (each tensor-parallel rank)."
    )
    resources: dict[str, PositiveFloat] = Field(
        default_factory=dict,
        description="Custom Ray resources each replica needs (in its first placement bundle), to "
        "place the model on nodes started with them, e.g. {model_node: 0.01}.",
    )

    @model_validator(mode="after")
    def _type_needs_gpu(self) -> Accelerator:
        if self.type is not None and self.kind != "gpu":
            raise ValueError(f"type ({self.type!r}) is only valid with kind 'gpu', not {self.kind!r}")
        return self


class AdmissionConfig(_Strict):
    """When a model counts as saturated, for shedding tiers (see ``TierConfig.shed_at``), and the
    engine slots kept for the top tier."""

    saturation_requests: PositiveInt | None = Field(
        default=None,
        description="In-flight requests (all gateway replicas together) at which the model is "
        "saturated with all its replicas (max_replicas when autoscaling) running; the gateway "
        "scales it by the share of replicas running now. None disables tier shedding for this "
        "model (its capacity, from "
        "deployment.max_ongoing_requests and max_queued_requests, still applies).",
    )
    reserved_slots: NonNegativeInt = Field(
        default=0,
        description="Slots of each engine (of engine.max_num_seqs) that only the top tier (the "
        "lowest priority value) may take. vLLM's scheduler never preempts for priority, so "
        "without a reserve a premium request waits for a long batch stream to finish. 0 turns "
        "the reserve off.",
    )


class FlowConfig(_Strict):
    """The gateway-side queue of one model (``serve_app.gateway.admission.flow``): a request goes to the engine
    only while the model's in-flight requests are under a bound that keeps the top tier's TTFT
    objective; otherwise it waits at the gateway, dequeued by tier band and fairly between tenants.
    Off by default: admission then behaves as without a queue (capacity and ``shed_at`` only)."""

    enabled: bool = Field(
        default=False,
        description="Queue requests at the gateway for this model (off: today's admission, for A/B).",
    )
    max_inflight_per_replica: PositiveInt | None = Field(
        default=None,
        description="Most requests in flight per running model replica (all gateway replicas "
        "together); None: engine.max_num_seqs, else deployment.max_ongoing_requests.",
    )
    min_inflight_per_replica: PositiveInt | None = Field(
        default=None,
        description="The adaptive bound never goes below this per running model replica (nor "
        "above its ceiling); None: a quarter of the ceiling. A floor of 4 of 64 cut throughput "
        "to a third in the flow bench at 4x load, where slow first tokens came from a starved "
        "CPU that a smaller batch does not help.",
    )
    ready_per_replica: NonNegativeInt | None = Field(
        default=None,
        description="Requests per running model replica sent past the ceiling (the engine's slots "
        "for the top tier, those less reserved_slots for the others) to wait in the replica's "
        "slot gate, tokenized and ready for the next free engine slot; None: an eighth of the "
        "engine's slots; 0: none. Without them a freed slot stays idle until the gateway learns "
        "of the end and sends the next request through the whole path (docs/PERFORMANCE.md, the "
        "flow queue). Not added to a bound the adaptive control has cut.",
    )
    adaptive: bool = Field(
        default=True,
        description="Tighten the lower tiers' bound while the engine's recent time to first token "
        "(the handle and engine stages) is over target_share of the top tier's TTFT objective, or "
        "while top-tier requests wait at the gateway for a slot, and loosen it again while "
        "requests wait and the engine keeps up (AIMD).",
    )
    target_share: float = Field(
        default=0.5, gt=0.0, le=1.0,
        description="Share of the top tier's TTFT objective that the engine's own time to first "
        "token may take (the rest is the front door, the gateway and the relay).",
    )
    quantum_tokens: PositiveInt = Field(
        default=1024,
        description="Deficit round-robin quantum: the tokens (reservation: prompt estimate plus "
        "completion bound) a tenant may send per turn within a tier band.",
    )
    max_waiting: PositiveInt = Field(
        default=1024,
        description="Most requests waiting in one gateway replica's queue for this model; past "
        "it a request is answered 503 with Retry-After.",
    )


class SyntheticUpstream(_Strict):
    """A model replica with no engine that streams made-up tokens (for sizing the gateway)."""

    tokens_per_s: PositiveFloat = Field(description="Tokens per second of each stream.")
    ttft_ms: float = Field(default=0.0, ge=0, le=60_000, description="Wait before the first token.")


class RoutingConfig(_Strict):
    """How the model's handle picks a replica (serve_app.engine.router)."""

    affinity: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Keep a tenant's session (or prompt prefix) on one replica, so its turns hit "
        "vLLM's prefix cache, under a load bound. auto: on for generate models with more than one "
        "replica (max_replicas when autoscaling); off: Ray Serve's default (power of two choices).",
    )
    load_factor: float = Field(
        default=1.25, ge=1.0, le=10.0,
        description="A replica takes a key's request only while its in-flight requests stay within "
        "this factor over the mean; otherwise the key re-homes to its next replica.",
    )
    max_keys: PositiveInt = Field(
        default=65_536, description="Re-homed keys each gateway replica remembers (LRU)."
    )


class ModelConfig(_Strict):
    """One served model: one Ray Serve deployment wrapping one vLLM engine per replica."""

    id: str = Field(pattern=_ID_RE)
    source: str = Field(
        min_length=1,
        description='"builtin:tiny-chat", "package:<python package>/<subdir>", a local path, '
        "or a hub id.",
    )
    task: Literal["generate", "embed"] = "generate"
    aliases: tuple[str, ...] = ()
    engine: EngineArgs = Field(default_factory=EngineArgs)
    frontend: dict[str, Any] = Field(
        default_factory=dict,
        description="vLLM OpenAI front-end options (chat_template, tool_call_parser, "
        "enable_auto_tool_choice, ...).",
    )
    deployment: DeploymentOptions = Field(default_factory=DeploymentOptions)
    accelerator: Accelerator = Field(default_factory=Accelerator)
    env: dict[str, str] = Field(default_factory=dict)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    flow: FlowConfig = Field(default_factory=FlowConfig)
    fallback: str | None = Field(
        default=None,
        description="Another model id that answers when this one is unavailable or its queue "
        "is full.",
    )
    startup_timeout_s: PositiveFloat = 900.0
    synthetic: SyntheticUpstream | None = Field(
        default=None,
        description="SYNTHETIC upstream for gateway benchmarks: no engine, no weights; streams "
        "made-up tokens at this rate (serve_app/engine/synthetic.py). Never for real traffic.",
    )
    # 50 ms is also Ray Serve LLM's default (RAYLLM_MODEL_RESPONSE_BATCH_TIMEOUT_MS).
    stream_interval_ms: float = Field(
        default=50.0,
        ge=0,
        le=1000,
        description="Streams send the role and first token at once, then read the engine at most "
        "once per interval; vLLM merges the tokens made meanwhile into one output, which becomes "
        "one SSE event and one message. Fewer, larger events cost less CPU per token on every "
        "hop; 0 sends each engine step.",
    )

    routing: RoutingConfig = Field(default_factory=RoutingConfig)

    @field_validator("aliases")
    @classmethod
    def _aliases_valid(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for alias in v:
            if not re.match(_ID_RE, alias):
                raise ValueError(f"alias ({alias!r}) must match {_ID_RE}")
        return v

    @model_validator(mode="after")
    def _parallelism_fits_accelerator(self) -> ModelConfig:
        backend = self.engine.distributed_executor_backend
        if self.accelerator.kind == "cpu" and backend == "ray":
            raise ValueError(
                "engine.distributed_executor_backend ('ray') is refused by vLLM on CPU; use 'mp'"
            )
        return self

    @model_validator(mode="after")
    def _synthetic_generates(self) -> ModelConfig:
        if self.synthetic is not None and self.task != "generate":
            raise ValueError(f"synthetic needs task 'generate', not {self.task!r}")
        return self

    @model_validator(mode="after")
    def _reserve_fits_engine(self) -> ModelConfig:
        reserved = self.admission.reserved_slots
        if not reserved:
            return self
        if self.task != "generate":
            raise ValueError(
                f"admission.reserved_slots ({reserved}) needs a generate model, not {self.task}"
            )
        if self.engine.scheduling_policy != "priority":
            raise ValueError(
                f"admission.reserved_slots ({reserved}) needs engine.scheduling_policy 'priority'"
            )
        seqs = self.engine.max_num_seqs
        if seqs is None or reserved >= seqs:
            raise ValueError(
                f"admission.reserved_slots ({reserved}) must be < engine.max_num_seqs ({seqs}); "
                "set max_num_seqs"
            )
        return self

    @model_validator(mode="after")
    def _affinity_generates(self) -> ModelConfig:
        if self.routing.affinity == "on" and self.task != "generate":
            raise ValueError(f"routing.affinity ('on') needs a generate model, not {self.task!r}")
        return self

    @property
    def affinity_routing(self) -> bool:
        """Whether the model's handle uses the affinity router (``routing.affinity``)."""
        if self.routing.affinity != "auto":
            return self.routing.affinity == "on"
        return self.task == "generate" and self.deployment.most_replicas > 1

    @property
    def deployment_name(self) -> str:
        """The Ray Serve deployment name: the id with characters Ray dislikes replaced."""
        return "model-" + re.sub(r"[^A-Za-z0-9_-]", "-", self.id)

    @property
    def world_size(self) -> int:
        return self.engine.tensor_parallel_size * self.engine.pipeline_parallel_size

    def engine_kwargs(self, model_path: str) -> dict[str, Any]:
        """vLLM ``AsyncEngineArgs`` keyword arguments for this model loaded from ``model_path``.

        Pure data (no vLLM import), so load tools can start a plain vLLM server with the same
        settings (``serve-app engine-args``) and unit tests can check it."""
        e = self.engine
        kw: dict[str, Any] = {
            k: v for k, v in e.model_dump(exclude={"extra"}).items() if v is not None
        }
        kw.update(e.extra)
        kw["model"] = model_path
        kw["served_model_name"] = [self.id]
        if self.task == "embed":
            kw["runner"] = "pooling"
        if self.world_size > 1 and "distributed_executor_backend" not in kw:
            kw["distributed_executor_backend"] = "mp" if self.accelerator.kind == "cpu" else "ray"
        kw.setdefault("disable_log_stats", False)
        return kw


class Limits(_Strict):
    """Per-key (or per-tier) limits. None means unlimited."""

    rpm: PositiveInt | None = Field(default=None, description="Requests per minute.")
    tpm: PositiveInt | None = Field(
        default=None, description="Prompt + completion tokens per minute."
    )
    max_concurrent: PositiveInt | None = Field(
        default=None, description="Requests in flight at once."
    )
    max_tokens_cap: PositiveInt | None = Field(
        default=None, description="A request's max_tokens is clamped to this."
    )

    def merged(self, override: Limits | None) -> Limits:
        if override is None:
            return self
        return self.model_copy(update=override.model_dump(exclude_unset=True))


class Objectives(_Strict):
    """The tier's service-level objectives, checked by load tests and dashboards."""

    ttft_p95_ms: PositiveFloat = 2000.0
    tpot_p95_ms: PositiveFloat = 200.0


class SplitTarget(_Strict):
    model: str
    weight: PositiveInt


class SplitRoute(_Strict):
    """A public model name whose traffic is split by weight across model deployments (A/B tests)."""

    name: str = Field(pattern=_ID_RE)
    split: tuple[SplitTarget, ...] = Field(min_length=1)


QUEUE_WAIT_OBJECTIVES = 3  # a tier's default max_queue_wait_s, in TTFT objectives


class TierConfig(_Strict):
    """An SLA tier: a vLLM scheduling priority, objectives, limits and when to shed it.

    ``priority`` becomes vLLM's request priority (lower runs first) on engines that use
    ``scheduling_policy: priority``. ``shed_at`` is the fraction of a model's
    ``admission.saturation_requests`` above which the gateway rejects this tier with 503: the tier
    with the lowest ``shed_at`` is shed first, and 1.0 means the tier is never shed early.
    """

    priority: int = 0
    description: str = ""
    objectives: Objectives = Field(default_factory=Objectives)
    limits: Limits = Field(default_factory=Limits)
    key_limits: Limits = Field(
        default_factory=Limits, description="The default limits of each key of the tier."
    )
    shed_at: float = Field(default=1.0, gt=0.0, le=1.0)
    max_queue_wait_s: PositiveFloat | None = Field(
        default=None,
        description="Longest a request of this tier waits in a model's gateway queue (flow.enabled) "
        "before it is answered 503 with Retry-After; None: 3 x the tier's TTFT objective.",
    )

    @property
    def queue_wait_s(self) -> float:
        """How long a request of this tier may wait in a gateway queue. The default is a few
        objectives: the objective bounds the p95, so a request that waited past it is in the
        tail, and answering it late serves its client better than a 503 that sends it to the
        back of the line (with a bound of one objective, 7-14 of ~1,300 premium requests got 503
        at 4x the base load in the flow bench while premium's p95 stayed at half the objective)."""
        if self.max_queue_wait_s is not None:
            return self.max_queue_wait_s
        return QUEUE_WAIT_OBJECTIVES * self.objectives.ttft_p95_ms / 1000


MAX_BODY_LIMIT = 32 * 1024 * 1024  # half the replica gRPC message limit (serve_app/local/front_door.py)


class BatchConfig(_Strict):
    """OpenAI's Batch API (``/v1/files``, ``/v1/batches``): where its files live and how its runner
    feeds the lines through the gateway's own admission, at the batch tier's priority."""

    files_dir: str | None = Field(
        default=None,
        description="Folder of uploaded and result files and, without gateway.redis_url, of the "
        "batches' state; None: a 'batch' folder beside gateway.keys_file (the local stack's "
        ".local/). Several gateway nodes need it on shared storage.",
    )
    max_file_bytes: PositiveInt = Field(
        default=64 * 1024 * 1024, description="Largest file upload (purpose batch)."
    )
    max_lines: PositiveInt = Field(default=50_000, description="Most requests in one batch.")
    tier: str | None = Field(
        default=None,
        description="The tier whose priority and limits batch lines run at (charged to the "
        "creator's key); None: 'batch' if configured, else the lowest-priority tier. A key whose "
        "own tier is lower still keeps it.",
    )
    concurrency: PositiveInt = Field(
        default=4, description="Lines of one batch in flight at once, per gateway replica."
    )
    max_active: PositiveInt = Field(
        default=1, description="Batches one gateway replica's runner runs at once."
    )
    lease_s: PositiveFloat = Field(
        default=30.0,
        description="A runner holds a batch by a lease it renews every third of this; a runner "
        "that dies leaves it to another replica (or its restart) after this long.",
    )
    poll_s: PositiveFloat = Field(default=2.0, description="How often a runner looks for batches.")
    backoff_max_s: PositiveFloat = Field(
        default=30.0, description="Longest wait before a line refused with 429 or 503 is retried."
    )


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


class AppConfig(_Strict):
    """Everything ``build_app`` needs: the ``args`` block of a Ray Serve config file."""

    models: tuple[ModelConfig, ...] = Field(min_length=1)
    routes: tuple[SplitRoute, ...] = ()
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    tiers: dict[str, TierConfig] = Field(default_factory=lambda: {"standard": TierConfig()})
    default_tier: str = "standard"
    cache_dir: str = "~/.cache/serve-app"

    @model_validator(mode="after")
    def _names_unique(self) -> AppConfig:
        seen: dict[str, str] = {}
        for m in self.models:
            for name in (m.id, *m.aliases):
                if name in seen:
                    raise ValueError(
                        f"model name ({name!r}) of model {m.id!r} is already used by model {seen[name]!r}"
                    )
                seen[name] = m.id
        deployments: dict[str, str] = {}
        for m in self.models:
            other = deployments.setdefault(m.deployment_name, m.id)
            if other != m.id:
                raise ValueError(
                    f"model ids ({other!r}, {m.id!r}) both become deployment {m.deployment_name!r}; "
                    "rename one"
                )
        by_id = {m.id: m for m in self.models}
        for m in self.models:
            if m.fallback is not None:
                fb = by_id.get(m.fallback)
                if fb is None or fb.id == m.id or fb.task != m.task:
                    raise ValueError(
                        f"fallback ({m.fallback!r}) of model {m.id!r} must be another {m.task} model id"
                    )
        for r in self.routes:
            if r.name in seen:
                raise ValueError(f"route name ({r.name!r}) is already used by model {seen[r.name]!r}")
            seen[r.name] = r.name
            tasks = set()
            for t in r.split:
                if t.model not in by_id:
                    raise ValueError(f"route {r.name!r}: split model ({t.model!r}) is not a model id")
                tasks.add(by_id[t.model].task)
            if len(tasks) > 1:
                raise ValueError(f"route {r.name!r} splits across models of different tasks {tasks}")
        limited = [
            name
            for name, t in self.tiers.items()
            if any((t.limits.rpm, t.limits.tpm, t.limits.max_concurrent,
                    t.key_limits.rpm, t.key_limits.tpm, t.key_limits.max_concurrent))
        ]
        if self.gateway.num_replicas > 1 and limited and not self.gateway.redis_url:
            raise ValueError(
                f"gateway.num_replicas ({self.gateway.num_replicas}) > 1 with limits on tiers "
                f"{limited} needs gateway.redis_url, so that replicas share their counters"
            )
        if self.default_tier not in self.tiers:
            raise ValueError(
                f"default_tier ({self.default_tier!r}) is not one of tiers {sorted(self.tiers)}"
            )
        return self

    @model_validator(mode="after")
    def _batch_tier_known(self) -> AppConfig:
        tier = self.gateway.batch.tier
        if tier is not None and tier not in self.tiers:
            raise ValueError(
                f"gateway.batch.tier ({tier!r}) is not one of tiers {sorted(self.tiers)}"
            )
        return self

    @model_validator(mode="after")
    def _served_model_fits(self) -> AppConfig:
        model_id = self.gateway.serve_model
        if model_id is None:
            return self
        m = next((m for m in self.models if m.id == model_id), None)
        if m is None:
            raise ValueError(f"gateway.serve_model ({model_id!r}) is not one of the models "
                             f"{sorted(x.id for x in self.models)}")
        if m.deployment.autoscaling_config is not None:
            raise ValueError(f"gateway.serve_model ({model_id!r}): the model served in the gateway "
                             "needs a fixed deployment.num_replicas, not autoscaling_config")
        if m.deployment.replicas != self.gateway.num_replicas:
            raise ValueError(f"gateway.serve_model ({model_id!r}): the gateway replicas are the "
                             f"model's, so deployment.num_replicas ({m.deployment.replicas}) must "
                             f"equal gateway.num_replicas ({self.gateway.num_replicas})")
        if m.routing.affinity == "on":
            raise ValueError(f"gateway.serve_model ({model_id!r}): routing.affinity ('on') picks one "
                             "of the model's deployment replicas, and a model served in the "
                             "gateway has none; set it to 'auto' or 'off'")
        return self

    @property
    def served_model(self) -> ModelConfig | None:
        """The model whose engine runs in the gateway replicas (``gateway.serve_model``), if any."""
        return self.model(self.gateway.serve_model) if self.gateway.serve_model else None

    @property
    def batch_tier(self) -> str:
        """The tier batch lines run at: ``gateway.batch.tier``, else 'batch' if configured, else
        the lowest-priority tier (the highest priority value)."""
        if self.gateway.batch.tier is not None:
            return self.gateway.batch.tier
        if "batch" in self.tiers:
            return "batch"
        return max(self.tiers, key=lambda name: self.tiers[name].priority)

    @property
    def top_priority(self) -> int:
        """The best (lowest) tier priority: the tier that may take a model's reserved slots."""
        return min(t.priority for t in self.tiers.values())

    def model(self, model_id: str) -> ModelConfig:
        for m in self.models:
            if m.id == model_id:
                return m
        raise KeyError(model_id)


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
        return self.tenant or self.id

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


def format_validation_error(err: ValidationError, root: str = "") -> str:
    """One line per problem: ``models.0.engine.max_num_seqs: Input should be greater than 0 (got 0)``."""
    lines = []
    errs = err.errors()
    locs = [tuple(e["loc"]) for e in errs]
    for e in errs:
        loc_t = tuple(e["loc"])
        # A container that fails only because an item failed adds nothing ("at least 1 item").
        if any(len(o) > len(loc_t) and o[: len(loc_t)] == loc_t for o in locs):
            continue
        loc = ".".join(str(p) for p in (root, *e["loc"]) if p != "")
        msg = e["msg"].removeprefix("Value error, ")
        got = e.get("input")
        shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
        lines.append(f"{loc or '<root>'}: {msg}{shown}")
    return "\n".join(lines)


def load_app_config(serve_config_path: str | Path, app_name: str | None = None) -> AppConfig:
    """Read a Ray Serve config file and validate its application's ``args``."""
    doc = yaml.safe_load(Path(serve_config_path).read_text())
    apps = doc.get("applications") if isinstance(doc, dict) else None
    apps = apps or []
    if not apps:
        raise ValueError(f"{serve_config_path}: no applications")
    app = next((a for a in apps if app_name in (None, a.get("name"))), None)
    if app is None:
        raise ValueError(f"{serve_config_path}: no application named {app_name!r}")
    return AppConfig.model_validate(app.get("args") or {})
