"""A long shared system prompt through the gateway: TTFT with prefix caching on and off, per tenant.

``python -m loadtests.bench.prefix`` starts the stack with two copies of ``tiny-chat``: one with
vLLM's prefix caching on (``tiny-chat``), one with it off (``tiny-chat-nocache``), and two keys, each
its own tenant (the gateway gives each tenant its own vLLM ``cache_salt``). Then, streaming
``/v1/chat/completions`` with a system prompt of about ``--system-tokens`` tokens (10,000) and a
short, different user message each time:

1. caching on vs off: ``--requests`` sequential requests to each model; TTFT p50 of the requests
   after the first (the first one fills the cache), and the cached prompt tokens vLLM reports
   (``usage.prompt_tokens_details.cached_tokens``);
2. tenants: with a fresh system prompt each round, tenant a twice, then tenant b twice: a's second
   request should be cached, b's first must not be (its salt differs), b's second should be.

Results: ``results/bench/prefix-<timestamp>.{json,md}``. Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench import procs
from loadtests.bench.procs import say
from loadtests.harness import stack as harness
from loadtests.harness.stack import ROOT

CACHED, UNCACHED = "tiny-chat", "tiny-chat-nocache"
TIER = "bench-unlimited"
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu policy "
         "customer answer always never politely refund order account support ticket").split()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench.prefix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--system-tokens", type=int, default=10_000, help="system prompt length (tokens)")
    p.add_argument("--requests", type=int, default=6, help="sequential requests per model")
    p.add_argument("--rounds", type=int, default=3, help="tenant rounds (a fresh prompt each)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--results-dir", default=str(ROOT / "results" / "bench"))
    return p.parse_args(argv)


def two_models_edit(args: dict[str, Any]) -> None:
    """tiny-chat with prefix caching on, a copy with it off (on the other core), no limits."""
    base = next(m for m in args["models"] if m["id"] == CACHED)
    on = json.loads(json.dumps(base))
    on["engine"] = {**on.get("engine", {}), "enable_prefix_caching": True}
    on.pop("admission", None)
    off = json.loads(json.dumps(on))
    off["id"], off["aliases"], off["adapters"] = UNCACHED, [], []  # names are unique
    off["engine"]["enable_prefix_caching"] = False
    off["env"] = {**off.get("env", {}), "VLLM_CPU_OMP_THREADS_BIND": "1"}
    args["models"] = [on, off]
    args["routes"] = []
    args["tiers"] = {TIER: {"priority": 0, "description": "prefix benchmark: no limits"}}
    args["default_tier"] = TIER


def system_prompt(rng: random.Random, words: int) -> str:
    return "You are a support agent. Rules: " + " ".join(rng.choice(WORDS) for _ in range(words))


def count_tokens(client: httpx.Client, root: str, key: str, text: str) -> int:
    r = client.post(f"{root}/tokenize", headers={"Authorization": f"Bearer {key}"},
                    json={"model": CACHED, "prompt": text})
    r.raise_for_status()
    return int(r.json()["count"])


def sized_prompt(client: httpx.Client, root: str, key: str, seed: int, tokens: int) -> tuple[str, int]:
    """A system prompt of about ``tokens`` tokens (scaled once from a measured sample)."""
    sample = system_prompt(random.Random(seed), 500)
    per_word = count_tokens(client, root, key, sample) / 500
    text = system_prompt(random.Random(seed), max(1, int(tokens / per_word)))
    return text, count_tokens(client, root, key, text)


def one_request(client: httpx.Client, base_url: str, key: str, model: str, system: str,
                user: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    t0 = time.monotonic()
    ttft = None
    usage: dict[str, Any] = {}
    with client.stream("POST", f"{base_url}/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            if ttft is None:
                ttft = (time.monotonic() - t0) * 1000.0
            doc = json.loads(line[6:])
            if doc.get("usage"):
                usage = doc["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return {"model": model, "ttft_ms": round(ttft or float("nan"), 1),
            "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": details.get("cached_tokens") or 0}


def markdown(doc: dict[str, Any]) -> str:
    a = doc["caching"]
    lines = [
        f"Command: `{doc['command']}`", "",
        f"System prompt {doc['system_tokens']} tokens; streaming chat, max_tokens {doc['max_tokens']}; "
        "TTFT measured by the client through the gateway.", "",
        "| Model | Prefix caching | TTFT p50 ms (requests 2..n) | first request ms | cached prompt tokens (p50) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for model, label in ((CACHED, "on"), (UNCACHED, "off")):
        rs = a[model]
        rest = rs[1:] or rs
        lines.append(f"| {model} | {label} | {statistics.median(r['ttft_ms'] for r in rest):.0f} | "
                     f"{rs[0]['ttft_ms']:.0f} | {statistics.median(r['cached_tokens'] for r in rest):.0f} |")
    lines += ["", "Tenants (each key its own tenant, so its own cache_salt), medians over rounds:", "",
              "| Request | TTFT p50 ms | cached prompt tokens (p50) |", "| --- | ---: | ---: |"]
    for step in ("a1", "a2", "b1", "b2"):
        rs = [rnd[step] for rnd in doc["tenants"]]
        lines.append(f"| tenant {step[0]}, request {step[1]} | "
                     f"{statistics.median(r['ttft_ms'] for r in rs):.0f} | "
                     f"{statistics.median(r['cached_tokens'] for r in rs):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    run = procs.new_run("prefix", "loadtests.bench.prefix", ns.config, ns.results_dir, argv)
    config, base, stamp, command = run.config, run.base, run.stamp, run.command
    workdir = Path(tempfile.mkdtemp(prefix="serve-app-prefix-"))
    stack = harness.start_stack(config, workdir, edit=two_models_edit, retries=1, say=say,
                                keys={"tenant-a": (TIER, ["*"]), "tenant-b": (TIER, ["*"])})
    try:
        ka, kb = stack.keys["tenant-a"], stack.keys["tenant-b"]
        with httpx.Client(timeout=300) as client:
            system, n_tokens = sized_prompt(client, stack.root_url, ka, 1, ns.system_tokens)
            say(f"system prompt: {n_tokens} tokens")
            caching: dict[str, list[dict[str, Any]]] = {}
            for model in (CACHED, UNCACHED):
                caching[model] = [one_request(client, stack.base_url, ka, model, system,
                                              f"question {i}: where is my order?", ns.max_tokens)
                                  for i in range(ns.requests)]
                say(f"{model}: TTFT ms {[r['ttft_ms'] for r in caching[model]]}, cached tokens "
                    f"{[r['cached_tokens'] for r in caching[model]]}")
            tenants = []
            for rnd in range(ns.rounds):
                fresh, _ = sized_prompt(client, stack.root_url, ka, 100 + rnd, ns.system_tokens)
                steps = {}
                for step, key in (("a1", ka), ("a2", ka), ("b1", kb), ("b2", kb)):
                    steps[step] = one_request(client, stack.base_url, key, CACHED, fresh,
                                              f"round {rnd} {step}: hello", ns.max_tokens)
                say(f"tenant round {rnd}: " + ", ".join(
                    f"{s} {r['ttft_ms']:.0f} ms ({r['cached_tokens']} cached)" for s, r in steps.items()))
                tenants.append(steps)
    finally:
        stack.stop(say=say)
    doc = {"command": command, "timestamp": stamp, "system_tokens": n_tokens, "max_tokens": ns.max_tokens,
           "caching": caching, "tenants": tenants}
    md = markdown(doc)
    procs.write_results(base, doc, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
