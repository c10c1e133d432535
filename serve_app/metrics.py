"""Every metric name, label set and bucket list, in one place (dashboards are generated from it).

Metrics go through Ray's metrics agent, which Prometheus scrapes on each node; Ray adds the ``ray_``
prefix (``serve_app_requests_total`` is scraped as ``ray_serve_app_requests_total``). Labels carry the
key id (bounded by the keys file), the tier and the model, never a secret.

The engine's own metrics come from vLLM's ``RayPrometheusStatLogger`` (``serve_app.engine.startup``)
and Ray Serve's from Ray itself; their exported names are listed here too (``ENGINE_METRICS``,
``SERVE_METRICS``), so a test can check that every series a dashboard or alert reads is declared.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray.util.metrics import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from serve_app.config import AppConfig

PREFIX = "serve_app_"
RAY_PREFIX = "ray_"  # what Ray's metrics agent puts in front of every application metric
KEY_LABELS = ("key_id", "tier", "model")
# TTFT and TPOT p95s are read from these buckets by linear interpolation, so they are no truer than
# the buckets are narrow: with 1 s and 2.5 s neighbours a true p95 of 1.3 s read as 2.1 s (issue
# 22's CI test). From 0.1 s to 5 s (TTFT) and 10 ms to 0.5 s (TPOT) neighbours are 20-33 % apart.
LATENCY_BUCKETS_S = [0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6,
                     0.75, 0.9, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 5, 7.5, 10, 15, 20, 30, 60]
TPOT_BUCKETS_S = [0.005, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125,
                  0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 1, 2]
# Stages run from under a millisecond (parse and auth) to seconds (a queue under load). Eleven
# boundaries keep the series bounded: tiers x models x 7 stages x 13 per gateway replica.
STAGE_BUCKETS_S = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10]
# Who a process metric is about: kind (gateway, model, haproxy, ...), the Ray Serve deployment and
# replica (bounded by each deployment's max_replicas; Ray drops its own WorkerId label, so without
# the replica two processes' gauges would overwrite each other).
PROCESS_LABELS = ("kind", "deployment", "replica")
# The HTTP status a rejection is answered with, so requests_total counts every admitted-or-refused
# request by status.
REJECTION_STATUS = {"rate_limit": 429, "shed": 503, "backpressure": 503, "budget": 429}
REJECTION_STATUS["queue_timeout"] = 503  # waited its tier's max_queue_wait_s in a flow queue

METRICS: dict[str, dict[str, Any]] = {
    "requests_total": {"kind": "counter", "labels": (*KEY_LABELS, "status"),
                       "help": "Requests answered by the gateway after authentication, by HTTP "
                               "status (rejections included: 429 rate_limit, 503 shed/backpressure)."},
    "tokens_total": {"kind": "counter", "labels": (*KEY_LABELS, "type"),
                     "help": "Tokens used, type=prompt|completion."},
    "rejections_total": {"kind": "counter", "labels": (*KEY_LABELS, "reason"),
                         "help": "Requests refused before the engine: rate_limit, shed, backpressure."},
    "slo_misses_total": {"kind": "counter", "labels": (*KEY_LABELS, "objective"),
                         "help": "Requests slower than their tier's objective (ttft or tpot)."},
    "goodput_total": {"kind": "counter", "labels": KEY_LABELS,
                      "help": "Requests answered with 2xx that met every objective of their tier "
                              "that applies (TTFT; TPOT when more than one token was generated)."},
    "ttft_seconds": {"kind": "histogram", "labels": ("tier", "model"), "buckets": LATENCY_BUCKETS_S,
                     "help": "Time to first token, measured at the gateway."},
    "tpot_seconds": {"kind": "histogram", "labels": ("tier", "model"), "buckets": TPOT_BUCKETS_S,
                     "help": "Time per output token after the first, measured at the gateway."},
    "stage_seconds": {"kind": "histogram", "labels": ("tier", "model", "stage"),
                      "buckets": STAGE_BUCKETS_S,
                      "help": "Time a request spent in one stage, from its arrival at the front "
                              "door (serve_app.gateway.accounting.timing.STAGES)."},
    "event_loop_lag_seconds": {"kind": "gauge", "labels": PROCESS_LABELS,
                               "help": "Longest lateness of the process's asyncio event loop in "
                                       "the last report window (a periodic sleep's late wake-up)."},
    "process_cpu_seconds_total": {"kind": "counter", "labels": PROCESS_LABELS,
                                  "help": "CPU seconds (user + system) used by the process."},
    "batch_lines_total": {"kind": "counter", "labels": ("key_id", "endpoint", "outcome"),
                          "help": "Batch API lines answered by the batch runner: outcome=completed "
                                  "(output file), failed (error file), retried (429/503, backed off)."},
    "batches_total": {"kind": "counter", "labels": ("status",),
                      "help": "Batches that reached a final status (completed, failed, cancelled, "
                              "expired)."},
    "batch_lines_pending": {"kind": "gauge", "labels": ("replica",),
                            "help": "Lines not yet answered in the batches a gateway replica's "
                                    "runner holds now."},
    "routing_decisions_total": {"kind": "counter", "labels": ("deployment", "decision"),
                                "help": "Requests placed by the affinity router "
                                        "(serve_app.gateway.routing.placement): decision=affinity (at its "
                                        "key's home), new (first sighting of its key), spill "
                                        "(home over the load bound; the key re-homes), none "
                                        "(no key)."},
    "adapter_loads_total": {"kind": "counter", "labels": ("deployment", "replica", "adapter", "result"),
                            "help": "LoRA adapters added at run time, as a model replica loads them on "
                                    "first use: result loaded, refused (cannot load) or replaced (its "
                                    "source changed; the old one unloaded once idle)."},
    "adapters_loaded": {"kind": "gauge", "labels": ("deployment", "replica"),
                        "help": "Run-time LoRA adapters a model replica has loaded now (vLLM's own LRU "
                                "over max_cpu_loras decides which weights stay in memory)."},
    "model_requests": {"kind": "gauge", "labels": ("deployment", "replica", "state"),
                       "help": "Requests a model replica has taken from gateways (its own endpoint, "
                               "serve_app.engine.endpoint): state=running (within "
                               "max_ongoing_requests) or waiting (queued in the replica)."},
    "audit_events_total": {"kind": "counter", "labels": ("action", "result"),
                           "help": "Audited events: admin API actions and failed authentications "
                                   "(action=auth_failed), by result."},
}

# The gateway's flow queues (serve_app.gateway.admission.flow): per model, tier and tenant (a key's tenant,
# else its id: bounded by the keys file), and the gateway replica (a gauge per replica, summed).
FLOW_LABELS = ("model", "tier", "tenant", "replica")
QUEUE_WAIT_BUCKETS_S = [0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
METRICS.update({
    "queue_depth": {"kind": "gauge", "labels": FLOW_LABELS,
                    "help": "Requests waiting in a gateway replica's flow queue for a model."},
    "queue_wait_seconds": {"kind": "histogram", "labels": (*FLOW_LABELS, "outcome"),
                           "buckets": QUEUE_WAIT_BUCKETS_S,
                           "help": "Time a request waited in a flow queue, by how it left: granted "
                                   "(a slot; 0 when one was free), expired (503 after its tier's "
                                   "max_queue_wait_s) or withdrawn (the client left)."},
    "flow_inflight_bound": {"kind": "gauge", "labels": ("model", "replica"),
                            "help": "Requests a gateway replica lets a model have in flight now "
                                    "(the flow queue's adaptive bound)."},
})

# vLLM 0.32's engine metrics as RayPrometheusStatLogger exports them: vLLM's "vllm:" becomes
# "vllm_" (OpenTelemetry names allow no colon) and Ray adds "ray_". Labels: model_name, engine,
# ReplicaId (the Ray Serve replica). Names checked by scraping a running stack
# (tests/integration/test_observability.py).
ENGINE_METRICS: dict[str, str] = {
    "ray_vllm_num_requests_running": "gauge",
    "ray_vllm_num_requests_waiting": "gauge",
    "ray_vllm_kv_cache_usage_perc": "gauge",
    "ray_vllm_prefix_cache_queries_total": "counter",
    "ray_vllm_prefix_cache_hits_total": "counter",
    "ray_vllm_num_preemptions_total": "counter",
    "ray_vllm_lora_requests_info": "gauge",
    "ray_vllm_prompt_tokens_total": "counter",
    "ray_vllm_generation_tokens_total": "counter",
    "ray_vllm_time_to_first_token_seconds": "histogram",
    "ray_vllm_inter_token_latency_seconds": "histogram",
    "ray_vllm_request_time_per_output_token_seconds": "histogram",
    "ray_vllm_request_success_total": "counter",
    "ray_vllm_e2e_request_latency_seconds": "histogram",
}

# Ray Serve's own metrics (Ray 2.60), as scraped from the same export.
SERVE_METRICS: dict[str, str] = {
    "ray_serve_deployment_replica_healthy": "gauge",
    "ray_serve_autoscaling_target_replicas": "gauge",
    "ray_serve_num_ongoing_requests_at_replicas": "gauge",
}

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def exported(name: str) -> str:
    """The name Prometheus sees for one of this module's METRICS."""
    return RAY_PREFIX + PREFIX + name


def declared_series() -> set[str]:
    """Every series name Prometheus may hold for the metrics declared here (histogram parts too)."""
    kinds = {exported(n): m["kind"] for n, m in METRICS.items()} | ENGINE_METRICS | SERVE_METRICS
    names: set[str] = set()
    for name, kind in kinds.items():
        names.add(name)
        if kind == "histogram":
            names.update(name + s for s in HISTOGRAM_SUFFIXES)
    return names


def with_objectives(base: Iterable[float], objectives_s: Iterable[float]) -> list[float]:
    """``base`` plus every objective (seconds), sorted, so a share within objective is exact."""
    return sorted({round(float(b), 6) for b in (*base, *objectives_s)})


def objective_buckets(cfg: AppConfig | None) -> tuple[list[float], list[float]]:
    """TTFT and TPOT bucket lists that hold every tier's objectives as a boundary."""
    tiers = list(cfg.tiers.values()) if cfg is not None else []
    ttft = with_objectives(LATENCY_BUCKETS_S, (t.objectives.ttft_p95_ms / 1000 for t in tiers))
    tpot = with_objectives(TPOT_BUCKETS_S, (t.objectives.tpot_p95_ms / 1000 for t in tiers))
    return ttft, tpot


def _made(name: str, boundaries: list[float] | None = None) -> Any:
    """The Ray metric object for ``METRICS[name]`` (``boundaries`` replace a histogram's own)."""
    m = METRICS[name]
    if m["kind"] == "counter":
        return Counter(PREFIX + name, description=m["help"], tag_keys=m["labels"])
    if m["kind"] == "gauge":
        return Gauge(PREFIX + name, description=m["help"], tag_keys=m["labels"])
    return Histogram(PREFIX + name, description=m["help"],
                     boundaries=boundaries if boundaries is not None else m["buckets"],
                     tag_keys=m["labels"])


@dataclass
class GatewayMetrics:
    """The gateway's metric objects; ``inc``/``observe`` take label dicts."""

    requests: Counter
    tokens: Counter
    rejections: Counter
    slo_misses: Counter
    goodput: Counter
    ttft: Histogram
    tpot: Histogram

    @classmethod
    def create(cls, cfg: AppConfig | None = None) -> GatewayMetrics:
        """The metric objects; with ``cfg``, the latency buckets hold every tier's objectives."""
        ttft_buckets, tpot_buckets = objective_buckets(cfg)
        buckets = {"ttft_seconds": ttft_buckets, "tpot_seconds": tpot_buckets}

        def make(name: str) -> Any:
            return _made(name, buckets.get(name))

        return cls(
            requests=make("requests_total"),
            tokens=make("tokens_total"),
            rejections=make("rejections_total"),
            slo_misses=make("slo_misses_total"),
            goodput=make("goodput_total"),
            ttft=make("ttft_seconds"),
            tpot=make("tpot_seconds"),
        )

    def request_finished(
        self,
        *,
        key_id: str,
        tier: str,
        model: str,
        status: int,
        prompt_tokens: int,
        completion_tokens: int,
        ttft_s: float | None,
        tpot_s: float | None,
        missed: tuple[str, ...],
    ) -> None:
        """One request answered (any status): its tokens, latencies and missed objectives."""
        tags = {"key_id": key_id, "tier": tier, "model": model}
        self.requests.inc(1, tags={**tags, "status": str(status)})
        if prompt_tokens:
            self.tokens.inc(prompt_tokens, tags={**tags, "type": "prompt"})
        if completion_tokens:
            self.tokens.inc(completion_tokens, tags={**tags, "type": "completion"})
        for objective in missed:
            self.slo_misses.inc(1, tags={**tags, "objective": objective})
        if 200 <= status < 300 and not missed:
            self.goodput.inc(1, tags=tags)
        lat = {"tier": tier, "model": model}
        if ttft_s is not None:
            self.ttft.observe(ttft_s, tags=lat)
        if tpot_s is not None:
            self.tpot.observe(tpot_s, tags=lat)

    def request_rejected(self, *, key_id: str, tier: str, model: str, reason: str) -> None:
        """One request refused before the engine: rate_limit, shed or backpressure."""
        tags = {"key_id": key_id, "tier": tier, "model": model}
        self.rejections.inc(1, tags={**tags, "reason": reason})
        self.requests.inc(1, tags={**tags, "status": str(REJECTION_STATUS.get(reason, 503))})


@dataclass
class StageMetrics:
    """The per-stage histogram (``serve_app.gateway.accounting.timing.StageClock.observe`` feeds it)."""

    stages: Histogram

    @classmethod
    def create(cls) -> StageMetrics:
        return cls(stages=_made("stage_seconds"))

    def stage_finished(self, *, tier: str, model: str, stage: str, seconds: float) -> None:
        self.stages.observe(seconds, tags={"tier": tier, "model": model, "stage": stage})


@dataclass
class ProcessMetrics:
    """One process's event-loop lag and CPU time (``serve_app.runtime.procwatch.LoopWatch`` feeds it)."""

    loop_lag: Gauge
    cpu: Counter
    tags: dict[str, str]

    @classmethod
    def create(cls, *, kind: str, deployment: str, replica: str) -> ProcessMetrics:
        return cls(loop_lag=_made("event_loop_lag_seconds"), cpu=_made("process_cpu_seconds_total"),
                   tags={"kind": kind, "deployment": deployment, "replica": replica})

    @classmethod
    def for_this_replica(cls, kind: str) -> ProcessMetrics:
        """Labelled by the Ray Serve replica this runs in (or ``local`` outside one: unit tests)."""
        from ray import serve
        from ray.serve.exceptions import RayServeException

        try:
            rc = serve.get_replica_context()
            deployment, replica = rc.deployment, rc.replica_tag
        except RayServeException:
            deployment, replica = kind, "local"
        return cls.create(kind=kind, deployment=deployment, replica=replica)

    def loop_lag_seen(self, seconds: float) -> None:
        self.loop_lag.set(seconds, tags=self.tags)

    def cpu_used(self, seconds: float) -> None:
        if seconds > 0:
            self.cpu.inc(seconds, tags=self.tags)


@dataclass
class BatchMetrics:
    """The batch runner's progress (``serve_app.batch.runner``)."""

    lines: Counter
    batches: Counter
    pending: Gauge
    replica: str

    @classmethod
    def create(cls, replica: str) -> BatchMetrics:
        return cls(lines=_made("batch_lines_total"), batches=_made("batches_total"),
                   pending=_made("batch_lines_pending"), replica=replica)

    def line_done(self, *, key_id: str, endpoint: str, outcome: str) -> None:
        self.lines.inc(1, tags={"key_id": key_id, "endpoint": endpoint, "outcome": outcome})

    def batch_done(self, status: str) -> None:
        self.batches.inc(1, tags={"status": status})

    def pending_now(self, lines: int) -> None:
        self.pending.set(lines, tags={"replica": self.replica})


@dataclass
class FlowMetrics:
    """The flow queues' depth, waits and bound (``serve_app.gateway.admission.flow.Flow`` feeds it)."""

    depth: Gauge
    wait: Histogram
    bound: Gauge
    replica: str

    @classmethod
    def create(cls, replica: str) -> FlowMetrics:
        return cls(depth=_made("queue_depth"), wait=_made("queue_wait_seconds"),
                   bound=_made("flow_inflight_bound"), replica=replica)

    @classmethod
    def for_this_replica(cls) -> FlowMetrics:
        """Labelled by the gateway replica this runs in (``local`` outside one)."""
        return cls.create(ProcessMetrics.for_this_replica("gateway").tags["replica"])

    def queue_depth(self, *, model: str, tier: str, tenant: str, depth: int) -> None:
        self.depth.set(depth, tags={"model": model, "tier": tier, "tenant": tenant,
                                    "replica": self.replica})

    def queue_waited(self, *, model: str, tier: str, tenant: str, seconds: float,
                     outcome: str) -> None:
        self.wait.observe(seconds, tags={"model": model, "tier": tier, "tenant": tenant,
                                         "replica": self.replica, "outcome": outcome})

    def inflight_bound(self, *, model: str, bound: int) -> None:
        self.bound.set(bound, tags={"model": model, "replica": self.replica})


@dataclass
class RouterMetrics:
    """The affinity router's decisions (``serve_app.gateway.routing.placement``), one counter per gateway process."""

    decisions: Counter

    @classmethod
    def create(cls) -> RouterMetrics:
        return cls(decisions=_made("routing_decisions_total"))

    def routed(self, *, deployment: str, decision: str) -> None:
        self.decisions.inc(1, tags={"deployment": deployment, "decision": decision})


@dataclass
class ModelRequestMetrics:
    """A model replica's requests running and waiting (``engine.deployment`` sets it each second:
    the gateway's requests do not cross Ray Serve's handles, so Ray's own gauges do not see them)."""

    requests: Gauge
    tags: dict[str, str]

    @classmethod
    def for_this_replica(cls) -> ModelRequestMetrics:
        process = ProcessMetrics.for_this_replica("model").tags
        return cls(_made("model_requests"), {"deployment": process["deployment"],
                                             "replica": process["replica"]})

    def seen(self, *, running: int, waiting: int) -> None:
        self.requests.set(running, tags={**self.tags, "state": "running"})
        self.requests.set(waiting, tags={**self.tags, "state": "waiting"})


@dataclass
class AdapterMetrics:
    """A model replica's run-time LoRA adapters (``serve_app.engine.loras`` feeds it)."""

    loads: Counter
    loaded: Gauge
    tags: dict[str, str]

    @classmethod
    def for_this_replica(cls) -> AdapterMetrics:
        process = ProcessMetrics.for_this_replica("model").tags
        return cls(_made("adapter_loads_total"), _made("adapters_loaded"),
                   {"deployment": process["deployment"], "replica": process["replica"]})

    def load(self, *, adapter: str, result: str, loaded: int) -> None:
        self.loads.inc(1, tags={**self.tags, "adapter": adapter, "result": result})
        self.loaded.set(loaded, tags=self.tags)


@dataclass
class AuditMetrics:
    """The audit trail's counter (``serve_app.gateway.accounting.audit.Audit`` feeds it)."""

    events: Counter

    @classmethod
    def create(cls) -> AuditMetrics:
        return cls(events=_made("audit_events_total"))

    def audited(self, *, action: str, result: str) -> None:
        self.events.inc(1, tags={"action": action, "result": result})
