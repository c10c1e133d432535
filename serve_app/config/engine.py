"""How one model runs: vLLM's engine arguments, the accelerator, and its Ray Serve deployment
options and autoscaling (``models[].engine``, ``.accelerator``, ``.deployment``, ``.synthetic``)."""

from __future__ import annotations

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

# The adapter ranks vLLM accepts for max_lora_rank (vllm.config.lora.MaxLoRARanks).
LoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]


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
    # vLLM's LoRA settings, under vLLM's names (None: vLLM's default). They size the engine's
    # adapter slots; the adapters themselves are the model's ``adapters``.
    enable_lora: bool = False
    max_loras: PositiveInt | None = Field(
        default=None, description="Adapters one engine batch may use at once (vLLM's default: 1)."
    )
    max_lora_rank: LoraRank | None = Field(
        default=None, description="The largest adapter rank the engine accepts (vLLM's default: 16)."
    )
    max_cpu_loras: PositiveInt | None = Field(
        default=None,
        description="Adapters kept loaded in CPU memory (vLLM's default: max_loras); >= max_loras.",
    )
    extra: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _extra_does_not_shadow(self) -> EngineArgs:
        typed = set(type(self).model_fields) - {"extra"}
        clash = sorted(typed & set(self.extra))
        if clash:
            raise ValueError(f"extra ({clash}) repeats typed engine fields; set them directly")
        return self

    @model_validator(mode="after")
    def _lora_settings(self) -> EngineArgs:
        if not self.enable_lora:
            given = [n for n in ("max_loras", "max_lora_rank", "max_cpu_loras")
                     if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{given[0]} ({getattr(self, given[0])}) needs enable_lora true")
            return self
        loras = self.max_loras or 1
        if self.max_cpu_loras is not None and self.max_cpu_loras < loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({loras})"
            )
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

class SyntheticUpstream(_Strict):
    """A model replica with no engine that streams made-up tokens (for sizing the gateway)."""

    tokens_per_s: PositiveFloat = Field(description="Tokens per second of each stream.")
    ttft_ms: float = Field(default=0.0, ge=0, le=60_000, description="Wait before the first token.")


# The step-time profiles of serve_app/engine/sim/profiles.json (a unit test keeps the two equal;
# the schema reads no engine file, so a typo fails at validation naming the known ones).
SimProfile = Literal[
    "cpu-tiny", "h100-llama3.1-8b", "h100-llama3.1-8b-tp2", "h100-llama3.1-8b-analytic",
    "h100-llama3.1-70b-tp4", "h200-llama3.1-8b", "h200-llama3.1-8b-tp2",
]


class SimulatedEngine(_Strict):
    """A SIMULATED engine (``serve_app/engine/sim``): vLLM's scheduler in modelled time, no weights.

    Its scheduler reads the model's own engine arguments (``engine.max_num_seqs``,
    ``max_num_batched_tokens``, ``block_size``, ``scheduling_policy``, ``enable_prefix_caching``,
    ``seed``), as the gateway's admission and flow queue do, so both see one number."""

    profile: SimProfile = Field(description="The step-time profile (GPU, model, parallelism).")
    time_scale: float = Field(
        default=1.0, gt=0, le=1000,
        description="Modelled seconds per wall-clock second: 4 runs the model 4x faster than the "
        "GPU would (every engine time the gateway sees is divided by it).",
    )
    num_blocks: PositiveInt = Field(
        default=8192,
        description="KV cache blocks of engine.block_size tokens (vLLM sizes them from GPU "
        "memory; here they are given).",
    )
