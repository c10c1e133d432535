"""One served model (``models[]``): its id and source, its admission, gateway queue and routing,
and the routes (``routes[]``) that split a public name across models."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from serve_app.config.base import _Strict
from serve_app.config.engine import (
    Accelerator,
    DeploymentOptions,
    EngineArgs,
    SimulatedEngine,
    SyntheticUpstream,
)

_ID_RE = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"


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

class RoutingConfig(_Strict):
    """How the gateway picks one of the model's replicas (serve_app.gateway.routing.placement)."""

    affinity: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Keep a tenant's session (or prompt prefix) on one replica, so its turns hit "
        "vLLM's prefix cache, under a load bound. auto: on for generate models with more than one "
        "replica (max_replicas when autoscaling); off: the less loaded of two replicas picked at random "
        "(power of two choices, Ray Serve's default policy).",
    )
    load_factor: float = Field(
        default=1.25, ge=1.0, le=10.0,
        description="A replica takes a key's request only while its in-flight requests stay within "
        "this factor over the mean; otherwise the key re-homes to its next replica.",
    )
    max_keys: PositiveInt = Field(
        default=65_536, description="Re-homed keys each gateway replica remembers (LRU)."
    )


# The adapters the project builds itself (serve_app/engine/tiny_lora.py), each with the builtin
# model it is made for: "builtin:<name>" as an adapter's source.
BUILTIN_ADAPTERS = {"tiny-chat-pirate": "builtin:tiny-chat"}
BUILTIN_PREFIX = "builtin:"


class AdapterConfig(_Strict):
    """One LoRA adapter of a model (``models[].adapters[]``): served by the model's deployment as
    a model of its own, under ``name`` (vLLM's ``lora_modules``)."""

    name: str = Field(
        pattern=_ID_RE,
        description="The model name clients call it by; unique across models, aliases and routes.",
    )
    source: str = Field(
        min_length=1,
        description='"builtin:tiny-chat-pirate" (built on first use, no download) or a PEFT '
        "adapter folder (adapter_config.json + adapter_model.safetensors) on the model's nodes.",
    )

    @field_validator("source")
    @classmethod
    def _builtin_known(cls, v: str) -> str:
        if v.startswith(BUILTIN_PREFIX) and v.removeprefix(BUILTIN_PREFIX) not in BUILTIN_ADAPTERS:
            raise ValueError(
                f"source ({v!r}) is not a builtin adapter; known: {sorted(BUILTIN_ADAPTERS)}"
            )
        return v

    @property
    def builtin(self) -> str | None:
        """The builtin adapter's name, or None for a folder."""
        return self.source.removeprefix(BUILTIN_PREFIX) if self.source.startswith(BUILTIN_PREFIX) else None

    @property
    def label(self) -> str:
        """What the model card's ``root`` shows for the adapter's source: a builtin's source, else
        the adapter's name (a folder's path is the server's business, never a client's)."""
        return self.source if self.builtin is not None else self.name


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
    adapters: tuple[AdapterConfig, ...] = Field(
        default=(),
        description="LoRA adapters served by this model's engines, each a model name of its own "
        "(needs engine.enable_lora).",
    )
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
    simulated: SimulatedEngine | None = Field(
        default=None,
        description="SIMULATED engine: vLLM's scheduling (batching, chunked prefill, prefix cache, "
        "priority, preemption) in modelled time with made-up tokens (serve_app/engine/sim). For "
        "fleet experiments on a CPU machine; never for real traffic.",
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
    def _adapters_fit(self) -> ModelConfig:
        if not self.adapters:
            if "lora_modules" in self.frontend:
                raise ValueError("frontend.lora_modules: give the model's adapters instead")
            return self
        names = [a.name for a in self.adapters]
        if self.task != "generate":
            raise ValueError(f"adapters ({names}) need a generate model, not {self.task!r}")
        if self.synthetic is not None or self.simulated is not None:
            raise ValueError(f"adapters ({names}) need a vLLM engine, not a synthetic or simulated one")
        if not self.engine.enable_lora:
            raise ValueError(f"adapters ({names}) need engine.enable_lora true")
        if "lora_modules" in self.frontend:
            raise ValueError("frontend.lora_modules and adapters are exclusive; give adapters")
        seen: set[str] = set()
        for a in self.adapters:
            if a.name in seen:
                raise ValueError(f"adapter name ({a.name!r}) is given twice in model {self.id!r}")
            seen.add(a.name)
            if a.name in (self.id, *self.aliases):
                raise ValueError(f"adapter name ({a.name!r}) is already a name of model {self.id!r}")
            base = BUILTIN_ADAPTERS.get(a.builtin or "")
            if base is not None and base != self.source:
                raise ValueError(
                    f"adapter source ({a.source!r}) is made for source {base!r}, not {self.source!r}"
                )
        return self

    @model_validator(mode="after")
    def _synthetic_generates(self) -> ModelConfig:
        if self.synthetic is not None and self.task != "generate":
            raise ValueError(f"synthetic needs task 'generate', not {self.task!r}")
        return self

    @model_validator(mode="after")
    def _simulated_alone(self) -> ModelConfig:
        if self.simulated is None:
            return self
        if self.synthetic is not None:
            raise ValueError("simulated and synthetic are exclusive; give one")
        if self.task != "generate":
            raise ValueError(f"simulated needs task 'generate', not {self.task!r}")
        if self.engine.kv_cache_memory_bytes is not None:
            raise ValueError(
                f"engine.kv_cache_memory_bytes ({self.engine.kv_cache_memory_bytes}) means nothing "
                "to a simulated engine; size its cache with simulated.num_blocks"
            )
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
        """Whether the gateway keeps affinity keys on replicas for this model (``routing.affinity``)."""
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

class SplitTarget(_Strict):
    model: str
    weight: PositiveInt


class SplitRoute(_Strict):
    """A public model name whose traffic is split by weight across model deployments (A/B tests)."""

    name: str = Field(pattern=_ID_RE)
    split: tuple[SplitTarget, ...] = Field(min_length=1)
