"""A SIMULATED engine: vLLM's scheduler semantics in modelled time, no weights, no vLLM.

``scheduler`` (continuous batching, chunked prefill, priority and preemption) over ``blocks`` (the
KV block pool with prefix caching), timed by ``profile`` (step-time models), driven by ``engine``
(one asyncio task that steps the batch), served by ``server`` (a ``backend.Backend``). Everything
but ``stats`` (Ray metrics, made lazily) runs without Ray, so a test drives it with a fake clock.
"""
