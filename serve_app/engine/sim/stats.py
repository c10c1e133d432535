"""The simulated engine's metrics, under the names vLLM's ``RayPrometheusStatLogger`` exports.

A real replica's engine series (``metrics.ENGINE_METRICS``: ``ray_vllm_*``) come from vLLM itself;
a simulated one has no vLLM, so this module makes the same series through Ray's metrics agent
(Ray adds ``ray_``), with vLLM's labels (``model_name``, ``engine``, ``ReplicaId``), so dashboards,
alerts and benches read a simulated fleet as a real one. Times are MODELLED seconds (what the GPU
would take), not the wall-clock time the gateway sees at a ``time_scale`` other than 1.

Ray is imported only when ``RayEngineStats`` is built (in the replica), so unit tests need none.
"""

from __future__ import annotations

from typing import Any

from serve_app.engine.sim.engine import StepReport
from serve_app.metrics import ENGINE_METRICS

# vLLM's bucket lists (vllm/v1/metrics/loggers.py), with the short end that a simulated GPU needs.
TTFT_BUCKETS_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                  7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS_S = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS_S = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
LABELS = ("model_name", "engine", "ReplicaId")


def _name(exported: str) -> str:
    """The name to create for an ``ENGINE_METRICS`` series (Ray adds the prefix)."""
    assert exported in ENGINE_METRICS, exported
    return exported.removeprefix("ray_")


class RayEngineStats:
    """``engine.StepSink`` that sets the ``ray_vllm_*`` series of one simulated replica."""

    def __init__(self, model: str, replica: str) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        def counter(n: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(_name(n), description=f"SIMULATED: {n}", tag_keys=LABELS + extra)

        def gauge(n: str) -> Any:
            return Gauge(_name(n), description=f"SIMULATED: {n}", tag_keys=LABELS)

        def histogram(n: str, buckets: list[float]) -> Any:
            return Histogram(_name(n), description=f"SIMULATED: {n} (modelled seconds)",
                             boundaries=buckets, tag_keys=LABELS)

        self.tags = {"model_name": model, "engine": "0", "ReplicaId": replica}
        self.running = gauge("ray_vllm_num_requests_running")
        self.waiting = gauge("ray_vllm_num_requests_waiting")
        self.kv_usage = gauge("ray_vllm_kv_cache_usage_perc")
        self.queries = counter("ray_vllm_prefix_cache_queries_total")
        self.hits = counter("ray_vllm_prefix_cache_hits_total")
        self.preemptions = counter("ray_vllm_num_preemptions_total")
        self.prompt = counter("ray_vllm_prompt_tokens_total")
        self.generation = counter("ray_vllm_generation_tokens_total")
        self.success = counter("ray_vllm_request_success_total", ("finished_reason",))
        self.ttft = histogram("ray_vllm_time_to_first_token_seconds", TTFT_BUCKETS_S)
        self.itl = histogram("ray_vllm_inter_token_latency_seconds", ITL_BUCKETS_S)
        self.tpot = histogram("ray_vllm_request_time_per_output_token_seconds", ITL_BUCKETS_S)
        self.e2e = histogram("ray_vllm_e2e_request_latency_seconds", E2E_BUCKETS_S)

    def step(self, r: StepReport) -> None:
        t = self.tags
        self.running.set(r.running, t)
        self.waiting.set(r.waiting, t)
        self.kv_usage.set(r.kv_usage, t)
        for counter, n in ((self.queries, r.cache_queries), (self.hits, r.cache_hits),
                           (self.preemptions, r.preemptions), (self.prompt, r.prompt_tokens),
                           (self.generation, r.generation_tokens)):
            if n:
                counter.inc(n, t)
        for v in r.ttfts:
            self.ttft.observe(v, t)
        for v in r.itls:
            self.itl.observe(v, t)
        for req in r.finished:
            self.success.inc(1, {**t, "finished_reason": "length"})
            if req.finished_at is None or req.first_token_at is None:
                continue
            self.e2e.observe(req.finished_at - req.arrival, t)
            if len(req.outputs) > 1:
                self.tpot.observe((req.finished_at - req.first_token_at) / (len(req.outputs) - 1), t)
