"""The SIMULATED engine (issue 39) in real Ray Serve replicas, through the real gateway.

A stack of its own: configs/sim-fleet.yaml (``sim-llama-8b``: the ``h100-llama3.1-8b`` profile,
``max_num_seqs`` 256, 28,000 KV blocks as on an H100, affinity routing) on ``REPLICAS`` replicas
that reserve no CPU. Chat requests go through the gateway with the openai SDK, streamed and not;
the answers say they are simulated; a repeated long prompt hits the prefix cache for its tenant's
key and not for another tenant's; and the replicas export the ``ray_vllm_*`` series, read from
Ray's metrics export as the affinity benchmark reads them.

Marked ``cluster``: its stack starts and stops before the session stack, so two never run at once.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from loadtests.bench.affinity import metrics_urls
from loadtests.harness.stack import ROOT, Stack, StackError, start_stack

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

MODEL = "sim-llama-8b"
REPLICAS = 3
KEYS = {"tenant-a": ("premium", ["*"]), "tenant-b": ("premium", ["*"])}  # tenant = key id
# About 4,000 made-up tokens (4 characters a token): 250 blocks of 16.
LONG = " ".join(f"line {i}: the agent reads file_{i % 97}.py and plans its next edit." for i in range(300))
SERIES = ("ray_vllm_prefix_cache_queries_total", "ray_vllm_prefix_cache_hits_total",
          "ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting",
          "ray_vllm_kv_cache_usage_perc", "ray_vllm_request_success_total",
          "ray_vllm_time_to_first_token_seconds_bucket")
SAMPLE = re.compile(r"^(ray_vllm_[a-z_]+)\{([^}]*)\} ([0-9.eE+-]+)$")


def _edit(args: dict[str, Any]) -> None:
    args["models"][0]["deployment"]["num_replicas"] = REPLICAS


@pytest.fixture(scope="module")
def sim_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    try:
        stack = start_stack(ROOT / "configs/sim-fleet.yaml", tmp_path_factory.mktemp("sim-stack"),
                            keys=KEYS, edit=_edit, timeout_s=600)
    except StackError as exc:
        pytest.fail(str(exc))
    try:
        yield stack
    finally:
        stack.stop()


def _client(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=stack.keys[key], timeout=120, max_retries=0)


def _cached(usage: Any) -> int:
    details = getattr(usage, "prompt_tokens_details", None)
    return int(getattr(details, "cached_tokens", None) or 0)


def test_answers_say_they_are_simulated(sim_stack: Stack) -> None:
    sdk = _client(sim_stack, "tenant-a")
    done = sdk.chat.completions.create(model=MODEL, max_tokens=12,
                                       messages=[{"role": "user", "content": "Who are you?"}])
    assert done.id.startswith("sim-"), done.id
    assert done.system_fingerprint == "serve-app-simulated"
    assert "simulated" in (done.choices[0].message.content or "")
    assert done.usage is not None and done.usage.completion_tokens == 12

    text, usage, chunks = [], None, 0
    for chunk in sdk.chat.completions.create(
            model=MODEL, max_tokens=20, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "Stream to me."}]):
        chunks += 1
        assert chunk.id.startswith("sim-"), chunk.id
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
        usage = chunk.usage or usage
    assert "simulated" in "".join(text)
    assert usage is not None and usage.completion_tokens == 20, usage
    assert chunks >= 2


def test_prefix_cache_is_shared_within_a_tenant_only(sim_stack: Stack) -> None:
    messages = [{"role": "system", "content": LONG}, {"role": "user", "content": "Go on."}]
    a, b = _client(sim_stack, "tenant-a"), _client(sim_stack, "tenant-b")
    first = a.chat.completions.create(model=MODEL, max_tokens=4, messages=messages)
    again = a.chat.completions.create(model=MODEL, max_tokens=4, messages=messages)
    other = b.chat.completions.create(model=MODEL, max_tokens=4, messages=messages)
    assert first.usage is not None and again.usage is not None and other.usage is not None
    assert first.usage.prompt_tokens > 3000, first.usage
    print(f"\n[sim] prompt {again.usage.prompt_tokens} tokens: tenant-a cached {_cached(first.usage)} "
          f"then {_cached(again.usage)}; tenant-b (same prompt) cached {_cached(other.usage)}")
    # The whole prompt but the block being filled (vLLM hashes full blocks only).
    assert _cached(again.usage) >= again.usage.prompt_tokens - 16, again.usage
    assert _cached(other.usage) == 0, other.usage
    assert other.usage.prompt_tokens == again.usage.prompt_tokens


def _scrape(urls: list[str]) -> dict[tuple[str, str], float]:
    """(series, ReplicaId) -> value summed over the other labels, for MODEL's series."""
    out: dict[tuple[str, str], float] = {}
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 (the node's own export)
            text = r.read().decode()
        for line in text.splitlines():
            m = SAMPLE.match(line)
            if not m:
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            if labels.get("model_name") != MODEL:
                continue
            k = (m.group(1), labels.get("ReplicaId", ""))
            out[k] = out.get(k, 0.0) + float(m.group(3))
    return out


def test_replicas_export_the_vllm_series(sim_stack: Stack) -> None:
    """After the traffic above, Ray's export has the prefix-cache counters with hits, and the
    engine gauges and histograms, labelled by replica (the export lags by up to ~10 s)."""
    sdk = _client(sim_stack, "tenant-a")
    messages = [{"role": "system", "content": LONG}, {"role": "user", "content": "Once more."}]
    for _ in range(2):
        sdk.chat.completions.create(model=MODEL, max_tokens=2, messages=messages)
    urls = metrics_urls(sim_stack)
    assert urls, "no metrics_export_port file in the stack's Ray session"
    deadline = time.monotonic() + 60
    while True:
        got = _scrape(urls)
        names = {name for name, _ in got}
        hits = sum(v for (n, _), v in got.items() if n == "ray_vllm_prefix_cache_hits_total")
        if (set(SERIES) <= names and hits > 0) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert set(SERIES) <= names, f"missing {sorted(set(SERIES) - names)}; exported {sorted(names)}"
    queries = sum(v for (n, _), v in got.items() if n == "ray_vllm_prefix_cache_queries_total")
    assert 0 < hits <= queries, (hits, queries)
    replicas = {r for (n, r), _ in got.items() if n == "ray_vllm_num_requests_running"}
    print(f"\n[sim] exported: prefix hits {hits:.0f} of {queries:.0f} queried tokens; "
          f"gauges from {len(replicas)} replica(s)")
    assert all(replicas) and 1 <= len(replicas) <= REPLICAS, replicas
