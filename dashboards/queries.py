"""Every PromQL query the dashboards, the alert rules and the PNG report use, built from the config.

One source: ``dashboards.build`` turns these panels into Grafana JSON, ``dashboards.alerts`` into
Prometheus rules, ``loadtests.report`` draws the SLA-tier panels with matplotlib, and the
observability integration test runs each one against a real Prometheus. Range windows are written
as Grafana's ``$__rate_interval``; ``concrete()`` swaps in a fixed window for direct queries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_app.config import AppConfig
from serve_app.metrics import exported

RATE = "$__rate_interval"
TTFT = exported("ttft_seconds")
TPOT = exported("tpot_seconds")
REQUESTS = exported("requests_total")
REJECTIONS = exported("rejections_total")
GOODPUT = exported("goodput_total")
SLO_MISSES = exported("slo_misses_total")
TOKENS = exported("tokens_total")
STAGE = exported("stage_seconds")
LOOP_LAG = exported("event_loop_lag_seconds")
CPU = exported("process_cpu_seconds_total")
BATCH_LINES = exported("batch_lines_total")
BATCH_PENDING = exported("batch_lines_pending")
BATCHES = exported("batches_total")
QUEUE_DEPTH = exported("queue_depth")
QUEUE_WAIT = exported("queue_wait_seconds")
FLOW_BOUND = exported("flow_inflight_bound")
ROUTING = exported("routing_decisions_total")
AUDIT = exported("audit_events_total")
MODEL_REQUESTS = exported("model_requests")
ADAPTER_LOADS = exported("adapter_loads_total")
ADAPTERS_LOADED = exported("adapters_loaded")


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    """One time-series panel: its queries, unit and, when it has one, the objective it is held to."""

    title: str
    unit: str
    targets: tuple[Target, ...]
    description: str = ""
    threshold: float | None = None  # drawn as a red dashed line (an objective or a limit)
    tier: str | None = None
    stacked: bool = False  # series are parts of one whole, drawn stacked


@dataclass(frozen=True)
class Board:
    uid: str
    title: str
    description: str
    rows: list[tuple[str, list[Panel]]] = field(default_factory=list)

    def panels(self) -> list[Panel]:
        return [p for _, panels in self.rows for p in panels]


def concrete(expr: str, window: str = "2m") -> str:
    """``expr`` with Grafana's range variable replaced by a fixed window, for Prometheus itself."""
    return expr.replace(RATE, window)


def le(seconds: float) -> str:
    """The ``le`` label of a bucket boundary as Ray's exporter writes it (Python float repr)."""
    return repr(float(seconds))


def _zero_if_none(expr: str, like: str) -> str:
    """``expr``, or zeros shaped like ``like`` when no such event happened yet (no "No data")."""
    return f"({expr}) or ({like} * 0)"


def tier_panels(tier: str, ttft_s: float, tpot_s: float, w: str = RATE) -> list[Panel]:
    sel = f'tier="{tier}"'
    all_requests = f"sum by (model) (rate({REQUESTS}{{{sel}}}[{w}]))"
    return [
        Panel(f"{tier}: TTFT p95 vs objective", "s", (
            Target(f"histogram_quantile(0.95, sum by (le, model) (rate({TTFT}_bucket{{{sel}}}[{w}])))",
                   "{{model}} TTFT p95"),), threshold=ttft_s, tier=tier,
              description=f"Time to first token at the gateway; objective {ttft_s:g} s."),
        Panel(f"{tier}: TPOT p95 vs objective", "s", (
            Target(f"histogram_quantile(0.95, sum by (le, model) (rate({TPOT}_bucket{{{sel}}}[{w}])))",
                   "{{model}} TPOT p95"),), threshold=tpot_s, tier=tier,
              description=f"Time per output token after the first; objective {tpot_s:g} s."),
        Panel(f"{tier}: share of requests within objective", "percentunit", (
            Target(f'sum by (model) (rate({TTFT}_bucket{{{sel},le="{le(ttft_s)}"}}[{w}])) / '
                   f"sum by (model) (rate({TTFT}_count{{{sel}}}[{w}]))", "{{model}} TTFT"),
            Target(f'sum by (model) (rate({TPOT}_bucket{{{sel},le="{le(tpot_s)}"}}[{w}])) / '
                   f"sum by (model) (rate({TPOT}_count{{{sel}}}[{w}]))", "{{model}} TPOT"),
        ), threshold=0.95, tier=tier,
              description="Share of requests at or under the objective (the objective is a bucket "
                          "boundary); the p95 objective holds while this stays above 95%."),
        Panel(f"{tier}: goodput", "reqps", (
            Target(f"sum by (model) (rate({GOODPUT}{{{sel}}}[{w}]))", "{{model}} goodput"),
            Target(all_requests, "{{model}} all requests"),
        ), tier=tier, description="Requests answered 2xx that met both objectives, against all."),
        Panel(f"{tier}: rejections by reason", "reqps", (
            Target(_zero_if_none(f"sum by (model, reason) (rate({REJECTIONS}{{{sel}}}[{w}]))",
                                 all_requests), "{{model}} {{reason}}"),
        ), tier=tier, description="rate_limit (429), shed and backpressure (503); 0 when none."),
        Panel(f"{tier}: requests by key and status", "reqps", (
            Target(f"sum by (key_id, status) (rate({REQUESTS}{{{sel}}}[{w}]))",
                   "{{key_id}} {{status}}"),
        ), tier=tier),
        Panel(f"{tier}: where the time goes (mean per stage)", "s", (
            Target(f"sum by (stage) (rate({STAGE}_sum{{{sel}}}[{w}])) / "
                   f"sum by (stage) (rate({STAGE}_count{{{sel}}}[{w}]))", "{{stage}}"),
        ), threshold=ttft_s, tier=tier, stacked=True,
              description="Mean seconds per request in each stage from the front door's arrival "
                          "stamp (docs/OBSERVABILITY.md); the stack up to relay is the mean TTFT."),
        Panel(f"{tier}: stage p95", "s", (
            Target(f"histogram_quantile(0.95, sum by (le, stage) (rate({STAGE}_bucket{{{sel}}}[{w}])))",
                   "{{stage}}"),
        ), threshold=ttft_s, tier=tier,
              description="95th percentile of each stage on its own (the tails do not add up)."),
    ]


def sla_board(cfg: AppConfig) -> Board:
    rows = []
    for name, tier in sorted(cfg.tiers.items(), key=lambda kv: kv[1].priority):
        o = tier.objectives
        rows.append((f"Tier {name} (priority {tier.priority})",
                     tier_panels(name, o.ttft_p95_ms / 1000, o.tpot_p95_ms / 1000)))
    return Board("serve-app-sla", "serve-app / SLA tiers",
                 "Each tier against its TTFT and TPOT objectives (from the app config).", rows)


def engine_board() -> Board:
    by = "model_name"
    running = f"sum by ({by}) (ray_vllm_num_requests_running)"
    queries = f"sum by ({by}) (rate(ray_vllm_prefix_cache_queries_total[{RATE}]))"

    def p95(metric: str) -> str:
        return f"histogram_quantile(0.95, sum by (le, {by}) (rate({metric}_bucket[{RATE}])))"

    return Board("serve-app-engines", "serve-app / Engines",
                 "vLLM's own engine metrics (RayPrometheusStatLogger), per model.", [
        ("Throughput and queues", [
            Panel("Output tokens/s", "short", (
                Target(f"sum by ({by}) (rate(ray_vllm_generation_tokens_total[{RATE}]))",
                       "{{model_name}}"),)),
            Panel("Running and waiting requests", "short", (
                Target(running, "{{model_name}} running"),
                Target(f"sum by ({by}) (ray_vllm_num_requests_waiting)", "{{model_name}} waiting"),
            )),
            Panel("KV-cache usage", "percentunit", (
                Target(f"max by ({by}, ReplicaId) (ray_vllm_kv_cache_usage_perc)",
                       "{{model_name}} {{ReplicaId}}"),), threshold=0.9),
            Panel("Prefix-cache hit rate", "percentunit", (
                Target(_zero_if_none(f"sum by ({by}) (rate(ray_vllm_prefix_cache_hits_total[{RATE}]))",
                                     queries) + f" / {queries}", "{{model_name}}"),),
                  description="Hit tokens over queried tokens (NaN while no prompt arrives)."),
            Panel("Preemptions/s", "short", (
                Target(_zero_if_none(f"sum by ({by}) (rate(ray_vllm_num_preemptions_total[{RATE}]))",
                                     running), "{{model_name}}"),)),
        ]),
        ("Engine latency (vLLM's histograms)", [
            Panel("Engine TTFT p95", "s", (
                Target(p95("ray_vllm_time_to_first_token_seconds"), "{{model_name}}"),)),
            Panel("Engine TPOT p95", "s", (
                Target(p95("ray_vllm_request_time_per_output_token_seconds"), "{{model_name}}"),)),
            Panel("Engine E2E latency p95", "s", (
                Target(p95("ray_vllm_e2e_request_latency_seconds"), "{{model_name}}"),)),
        ]),
        ("Replica affinity (serve_app.gateway.routing.placement)", affinity_panels()),
        ("LoRA adapters added at run time (serve_app.engine.loras)", adapter_panels()),
    ])


def adapter_panels() -> list[Panel]:
    """Run-time adapters as the model replicas load them: loads (and refusals, swaps) per second,
    and how many each replica holds (zeros while none was ever added)."""
    per_replica = f"max by (deployment, replica) ({MODEL_REQUESTS})"
    return [
        Panel("Adapter loads/s", "short", (
            Target(_zero_if_none(f"sum by (deployment, result) (rate({ADAPTER_LOADS}[{RATE}]))",
                                 f"sum by (deployment) ({MODEL_REQUESTS})"),
                   "{{deployment}} {{result}}"),), stacked=True,
              description="loaded: a replica loaded an adapter on its first request for it; "
                          "refused: it could not; replaced: its source changed (the old one "
                          "unloaded once idle). Loads per request show whether routing keeps each "
                          "adapter on its home replica."),
        Panel("Run-time adapters loaded per replica", "short", (
            Target(_zero_if_none(f"max by (deployment, replica) ({ADAPTERS_LOADED})", per_replica),
                   "{{deployment}} {{replica}}"),),
              description="Adapters each replica has loaded; vLLM's own LRU over max_cpu_loras "
                          "decides which weights stay in memory."),
    ]


def affinity_panels() -> list[Panel]:
    """Whether scale-out keeps the prefix cache: each replica's own hit rate, and how the affinity
    router placed requests (a steady share of spills means the load bound is doing the work)."""
    by = "model_name, ReplicaId"
    queries = f"sum by ({by}) (rate(ray_vllm_prefix_cache_queries_total[{RATE}]))"
    return [
        Panel("Prefix-cache hit rate per replica", "percentunit", (
            Target(_zero_if_none(f"sum by ({by}) (rate(ray_vllm_prefix_cache_hits_total[{RATE}]))",
                                 queries) + f" / {queries}", "{{model_name}} {{ReplicaId}}"),),
              description="vLLM's own counters (hit tokens over queried tokens) for each replica; "
                          "with affinity routing on, each replica should hit about as often as one "
                          "replica alone."),
        Panel("Routing decisions/s", "reqps", (
            Target(_zero_if_none(f"sum by (deployment, decision) (rate({ROUTING}[{RATE}]))",
                                 f"sum(rate({REQUESTS}[{RATE}]))"),
                   "{{deployment}} {{decision}}"),), stacked=True,
              description="affinity: at the key's home; new: first sighting of a key; spill: the "
                          "home was over the load bound and the key re-homed; none: no key."),
    ]


def capacity_board(cfg: AppConfig) -> Board:
    ongoing = [
        Panel(f"{m.id}: ongoing requests per replica", "short", (
            Target(f'sum by (replica, state) ({MODEL_REQUESTS}{{deployment="{m.deployment_name}"}})',
                   "{{replica}} {{state}}"),), threshold=float(m.deployment.max_ongoing_requests),
              description=f"Running (at most max_ongoing_requests, "
                          f"{m.deployment.max_ongoing_requests}) and waiting in the replica.")
        for m in cfg.models
    ]
    return Board("serve-app-capacity", "serve-app / Capacity",
                 "Ray Serve's replicas, ongoing and queued requests, and autoscaling decisions.", [
        ("Replicas", [
            Panel("Healthy replicas per deployment", "short", (
                Target("sum by (deployment) (ray_serve_deployment_replica_healthy)", "{{deployment}}"),)),
            Panel("Autoscaling decisions: target replicas", "short", (
                Target("max by (deployment) (ray_serve_autoscaling_target_replicas)",
                       "{{deployment}} target"),
                Target("sum by (deployment) (ray_serve_deployment_replica_healthy)",
                       "{{deployment}} healthy"),
            )),
            Panel("Requests waiting in model replicas", "short", (
                Target(f'sum by (deployment) ({MODEL_REQUESTS}{{state="waiting"}})', "{{deployment}}"),),
                  description="Past max_ongoing_requests, in each replica's own queue."),
        ]),
        ("Ongoing requests", ongoing),
        ("Front end: event loops and CPU", [
            Panel("Event-loop lag (worst in 5 s)", "s", (
                Target(f"max by (kind, deployment) ({LOOP_LAG})", "{{kind}} {{deployment}}"),),
                  description="How late a periodic 0.25 s sleep woke on each replica's event loop: "
                              "every request on that loop waited as long."),
            Panel("CPU per 1,000 completion tokens", "s", (
                # on() group_left: the per-kind CPU over the one total of tokens (no shared labels).
                Target(f"sum by (kind) (rate({CPU}[{RATE}])) / on() group_left() "
                       f'(sum(rate({TOKENS}{{type="completion"}}[{RATE}])) / 1000)', "{{kind}}"),),
                  description="CPU seconds of the gateway and the model replicas' processes per "
                              "1,000 tokens generated: the front end's cost per token."),
            Panel("CPU cores used", "short", (
                Target(f"sum by (kind, deployment) (rate({CPU}[{RATE}]))", "{{kind}} {{deployment}}"),)),
        ]),
        ("Batch API", [
            Panel("Batch lines answered per second", "reqps", (
                Target(f"sum by (outcome) (rate({BATCH_LINES}[{RATE}]))", "{{outcome}}"),),
                  description="Lines of /v1/batches answered by the gateways' runners: completed "
                              "(output file), failed (error file), retried (refused with 429/503 "
                              "and backed off: interactive tiers had the capacity)."),
            Panel("Batch lines pending", "short", (
                Target(_zero_if_none(f"sum({BATCH_PENDING})", f"sum(rate({REQUESTS}[{RATE}]))"),
                       "pending"),),
                  description="Lines not yet answered in the batches the runners hold now."),
            Panel("Batches finished", "short", (
                Target(f"sum by (status) (increase({BATCHES}[{RATE}]))", "{{status}}"),),
                  description="Batches that reached a final status in the window."),
        ]),
        ("Gateway flow queue", flow_panels()),
        ("Keys: admin actions and failed authentications", [
            Panel("Audited events per second", "reqps", (
                Target(f"sum by (action, result) (rate({AUDIT}[{RATE}]))", "{{action}} {{result}}"),),
                  description="Admin API actions and failed authentications (action auth_failed), "
                              "each also a line in the audit log."),
        ]),
    ])


def flow_panels(w: str = RATE) -> list[Panel]:
    """The gateway's flow queues (models with ``flow.enabled``); zeros while no queue is on."""
    like = f"sum by (model) (rate({REQUESTS}[{w}]))"
    return [
        Panel("Flow queue: waiting by tier", "short", (
            Target(_zero_if_none(f"sum by (model, tier) ({QUEUE_DEPTH})", like),
                   "{{model}} {{tier}}"),),
              description="Requests waiting at the gateway for a slot, all gateway replicas."),
        Panel("Flow queue: waiting by tenant", "short", (
            Target(_zero_if_none(f"sum by (model, tenant) ({QUEUE_DEPTH})", like),
                   "{{model}} {{tenant}}"),),
              description="Who waits: a noisy tenant's queue grows, a quiet one's stays short."),
        Panel("Flow queue: wait p95 by tier", "s", (
            Target(_zero_if_none(
                f"histogram_quantile(0.95, sum by (le, tier) (rate({QUEUE_WAIT}_bucket[{w}])))",
                like), "{{tier}}"),),
              description="Time in the queue (0 for a request that found a free slot)."),
        Panel("Flow queue: wait p95 by tenant", "s", (
            Target(_zero_if_none(
                f"histogram_quantile(0.95, sum by (le, tenant) (rate({QUEUE_WAIT}_bucket[{w}])))",
                like), "{{tenant}}"),),
              description="Deficit round-robin keeps a quiet tenant's wait short under a noisy one."),
        Panel("Flow queue: how requests left it", "reqps", (
            Target(_zero_if_none(
                f"sum by (tier, outcome) (rate({QUEUE_WAIT}_count[{w}]))", like),
                "{{tier}} {{outcome}}"),),
              description="granted (a slot), expired (503 after the tier's max_queue_wait_s), "
                          "withdrawn (the client left)."),
        Panel("Flow queue: in-flight bound", "short", (
            Target(_zero_if_none(f"sum by (model) ({FLOW_BOUND})", like), "{{model}}"),),
              description="Requests the gateway lets each model have in flight (adaptive: cut "
                          "while the engine's TTFT is over target, grown while requests wait)."),
    ]


def boards(cfg: AppConfig) -> list[Board]:
    return [sla_board(cfg), engine_board(), capacity_board(cfg)]
