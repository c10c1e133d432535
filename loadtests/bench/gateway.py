"""Gateway capacity against a SYNTHETIC upstream: how many streams and tokens/s one gateway core relays.

``python -m loadtests.bench.gateway --replicas 1,2,4`` starts the stack (``serve-app run``) with one
model, a synthetic upstream (``synthetic: {tokens_per_s, ttft_ms}``: no engine, made-up tokens at a
set rate per stream, serve_app/engine/synthetic.py) and R gateway replicas. For each R and each
stream count N it offers Poisson arrivals at N / (stream duration) requests/s, so that about N
streams are open, and measures over a steady window:

- added TTFT: the client's time to the first token minus the upstream's ``ttft_ms`` (p50, p99);
- tokens/s relayed to the client;
- the CPU the gateway replicas used (cores), hence tokens/s and streams per gateway core.

The first (smallest) stream count gives the floor: the added TTFT of the whole path at almost no
load (HAProxy, the gateway, Ray Serve's hop to the model replica and back; about 6-7 ms here). The
capacity of a setting is the largest N whose added TTFT p50 stays within ``--max-added-ms`` (5 ms)
of that floor, i.e. what load adds to it; the sizing rule is the tokens/s per gateway core there. On GPU hosts the engine does not
compete with the front end, which is what this isolates; here the client, HAProxy and the
synthetic replica share the machine's cores with the gateway, so per-core figures are the ones to
use. Results: ``results/bench/gateway-<timestamp>.{json,md}``. Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtests.bench import procs as procs
from loadtests.harness import stack as harness
from loadtests.harness.stack import ROOT

MODEL = "synthetic-chat"
TIER = "bench-unlimited"
TOKEN = b"synthetic "


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench.gateway", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/local.yaml", help="base config (gateway settings)")
    p.add_argument("--replicas", default="1,2,4", help="gateway replica counts")
    p.add_argument("--streams", default="2,8,16,32,48,64,96",
                   help="open streams to offer, in order; the first one measures the floor")
    p.add_argument("--tokens-per-s", type=float, default=100.0, help="synthetic tokens/s per stream")
    p.add_argument("--ttft-ms", type=float, default=20.0, help="synthetic time to first token")
    p.add_argument("--output-len", type=int, default=64, help="tokens per stream")
    p.add_argument("--window-s", type=float, default=10.0, help="measured seconds per step")
    p.add_argument("--max-added-ms", type=float, default=5.0, help="added TTFT p50 budget")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default=str(ROOT / "results" / "bench"))
    ns = p.parse_args(argv)
    ns.replica_counts = [int(x) for x in ns.replicas.split(",") if x.strip()]
    ns.stream_counts = [int(x) for x in ns.streams.split(",") if x.strip()]
    return ns


def synthetic_edit(replicas: int, tokens_per_s: float, ttft_ms: float) -> harness.EditArgs:
    """The stack's config: one synthetic model, R gateway replicas, one tier without limits (so
    several replicas need no Redis)."""

    def edit(args: dict[str, Any]) -> None:
        args["models"] = [{
            "id": MODEL, "source": "synthetic",
            "synthetic": {"tokens_per_s": tokens_per_s, "ttft_ms": ttft_ms},
            "deployment": {"num_replicas": 1, "max_ongoing_requests": 4096},
            "accelerator": {"kind": "cpu", "cpus_per_worker": 0.5},
        }]
        args["tiers"] = {TIER: {"priority": 0, "description": "gateway benchmark: no limits"}}
        args["default_tier"] = TIER
        args["routes"] = []
        args["gateway"] = {**(args.get("gateway") or {}), "num_replicas": replicas,
                           "max_ongoing_requests": 4096}
    return edit


def stream_duration_s(ns: argparse.Namespace) -> float:
    return float(ns.ttft_ms / 1000.0 + (ns.output_len - 1) / ns.tokens_per_s)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100.0 * (len(s) - 1))))]


async def one_stream(session: Any, url: str, key: str, ns: argparse.Namespace,
                     rec: dict[str, Any]) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": ns.output_len, "stream": True}
    t0 = time.monotonic()
    rec["start"] = t0
    try:
        async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status != 200:
                rec["error"] = f"HTTP {r.status}"
                return
            async for data in r.content.iter_any():
                n = data.count(TOKEN)
                if n:
                    now = time.monotonic()
                    if "ttft" not in rec:
                        rec["ttft"] = now - t0
                    rec.setdefault("chunks", []).append((now, n))
        rec["end"] = time.monotonic()
    except Exception as exc:  # counted as a failed stream
        rec["error"] = f"{type(exc).__name__}: {exc}"


async def run_step(url: str, key: str, root: int, ns: argparse.Namespace, streams: int,
                   rng: random.Random) -> dict[str, Any]:
    """Poisson arrivals for warm-up + window; returns the window's figures."""
    import aiohttp

    duration = stream_duration_s(ns)
    rate = streams / duration
    warm = duration + 1.0
    recs: list[dict[str, Any]] = []
    tasks: list[asyncio.Task[None]] = []
    cpu: dict[str, dict[str, float]] = {}
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        t0 = time.monotonic()
        w0, w1 = t0 + warm, t0 + warm + ns.window_s

        async def sampler() -> None:
            await asyncio.sleep(max(0.0, w0 - time.monotonic()))
            cpu["start"] = procs.cpu_seconds(root)
            await asyncio.sleep(max(0.0, w1 - time.monotonic()))
            cpu["end"] = procs.cpu_seconds(root)

        samp = asyncio.create_task(sampler())
        nxt = t0
        while nxt < w1:
            nxt += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            rec: dict[str, Any] = {}
            recs.append(rec)
            tasks.append(asyncio.create_task(one_stream(s, url, key, ns, rec)))
        await samp
        await asyncio.wait(tasks, timeout=duration + 30)
        for t in tasks:
            t.cancel()
    in_window = [r for r in recs if "start" in r and w0 <= r["start"] < w1]
    added = [(r["ttft"] - ns.ttft_ms / 1000.0) * 1000.0 for r in in_window if "ttft" in r]
    tokens = sum(n for r in recs for (t, n) in r.get("chunks", []) if w0 <= t < w1)
    used = {k: cpu["end"].get(k, 0.0) - cpu["start"].get(k, 0.0) for k in cpu.get("end", {})}
    gw = sum(v for k, v in used.items() if ":gateway" in k) / ns.window_s
    errors = [r["error"] for r in in_window if "error" in r]
    tok_s = tokens / ns.window_s
    return {
        "streams": streams, "arrivals_per_s": round(rate, 2), "requests_in_window": len(in_window),
        "failed": len(errors), "errors": sorted(set(errors))[:3],
        "added_ttft_p50_ms": round(statistics.median(added), 2) if added else None,
        "added_ttft_p99_ms": round(pct(added, 99), 2) if added else None,
        "tok_s": round(tok_s, 1), "gateway_cores": round(gw, 3),
        "tok_s_per_gateway_core": round(tok_s / gw, 0) if gw > 0 else None,
        "streams_per_gateway_core": round(streams / gw, 1) if gw > 0 else None,
        "cpu_cores": {k: round(v / ns.window_s, 3) for k, v in sorted(used.items(), key=lambda kv: -kv[1])
                      if v / ns.window_s >= 0.01},
    }


def floor_ms(steps: list[dict[str, Any]]) -> float:
    """The added TTFT p50 of the first (lightest) step: the path's own latency at almost no load."""
    first = steps[0]["added_ttft_p50_ms"] if steps else None
    return float(first) if first is not None else 0.0


def capacity(steps: list[dict[str, Any]], budget_ms: float) -> dict[str, Any] | None:
    """The largest step whose added TTFT p50 is within ``budget_ms`` of the floor (the first
    step's) and that lost no stream."""
    limit = floor_ms(steps) + budget_ms
    ok = [s for s in steps if s["added_ttft_p50_ms"] is not None and s["added_ttft_p50_ms"] <= limit
          and not s["failed"]]
    return max(ok, key=lambda s: s["streams"]) if ok else None


def markdown(results: dict[int, list[dict[str, Any]]], ns: argparse.Namespace, command: str) -> str:
    lines = [
        f"Command: `{command}`", "",
        f"SYNTHETIC upstream: {ns.tokens_per_s:.0f} tokens/s per stream, TTFT {ns.ttft_ms:.0f} ms, "
        f"{ns.output_len} tokens per stream, 50 ms stream interval; Poisson arrivals; "
        f"{ns.window_s:.0f} s window per step;.", "",
        "| Gateway replicas | Streams | Tok/s relayed | Added TTFT p50 ms | p99 ms | Gateway cores "
        "| Tok/s per gateway core | Streams per gateway core | Failed |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r, steps in results.items():
        for s in steps:
            lines.append(
                f"| {r} | {s['streams']} | {s['tok_s']:.0f} | {s['added_ttft_p50_ms']} | "
                f"{s['added_ttft_p99_ms']} | {s['gateway_cores']:.2f} | {s['tok_s_per_gateway_core']} | "
                f"{s['streams_per_gateway_core']} | {s['failed']} |")
    lines += ["", f"Capacity (largest step whose added TTFT p50 is within {ns.max_added_ms:.0f} ms of the "
              "floor, the first step's):", ""]
    for r, steps in results.items():
        cap = capacity(steps, ns.max_added_ms)
        lines.append(f"- {r} replica(s), floor {floor_ms(steps):.1f} ms: " + (
            f"{cap['streams']} streams, {cap['tok_s']:.0f} tok/s, {cap['tok_s_per_gateway_core']} tok/s "
            f"and {cap['streams_per_gateway_core']} streams per gateway core" if cap else "none within budget"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    run = procs.new_run("gateway", "loadtests.bench.gateway", ns.config, ns.results_dir, argv)
    config, base, stamp, command = run.config, run.base, run.stamp, run.command
    rng = random.Random(ns.seed)
    results: dict[int, list[dict[str, Any]]] = {}
    for r in ns.replica_counts:
        workdir = Path(tempfile.mkdtemp(prefix="serve-app-gwbench-"))
        procs.say(f"{r} gateway replica(s): starting the stack with a SYNTHETIC upstream")
        stack = harness.start_stack(config, workdir, keys={"bench": (TIER, [MODEL])},
                                    edit=synthetic_edit(r, ns.tokens_per_s, ns.ttft_ms), retries=1,
                                    say=procs.say)
        try:
            url = f"{stack.base_url}/chat/completions"
            results[r] = []
            for n in ns.stream_counts:
                step = asyncio.run(run_step(url, stack.keys["bench"], stack.proc.pid, ns, n, rng))
                procs.say(f"  R={r} streams={n}: {step['tok_s']:.0f} tok/s, added TTFT p50 "
                          f"{step['added_ttft_p50_ms']} ms p99 {step['added_ttft_p99_ms']} ms, gateway "
                          f"{step['gateway_cores']:.2f} cores, {step['tok_s_per_gateway_core']} tok/s per "
                          f"gateway core, {step['failed']} failed")
                results[r].append(step)
                if step["added_ttft_p50_ms"] is None or \
                        step["added_ttft_p50_ms"] > floor_ms(results[r]) + 3 * ns.max_added_ms:
                    break  # far past the budget: larger steps only queue
        finally:
            stack.stop(say=procs.say)
    md = markdown(results, ns, command)
    doc = {"command": command, "timestamp": stamp, "settings": {
        k: getattr(ns, k) for k in ("tokens_per_s", "ttft_ms", "output_len", "window_s", "max_added_ms")},
        "results": {str(r): v for r, v in results.items()},
        "capacity": {str(r): capacity(v, ns.max_added_ms) for r, v in results.items()}}
    procs.write_results(base, doc, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
