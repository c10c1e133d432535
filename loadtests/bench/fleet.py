"""Fleet scenarios on SIMULATED H100s (issue 39): the affinity router against the default router.

``--scenario affinity`` (the default, described here), ``fairness`` (a noisy key beside 8 quiet
keys: loadtests/bench/fleet_fairness.py, its own options) or ``all`` (each with its defaults; only
``--results-dir`` and ``--seed`` are passed on).

``python -m loadtests.bench.fleet`` (``make bench-fleet``) starts one stack from
configs/sim-fleet.yaml with two copies of ``sim-llama-8b`` (serve_app/engine/sim: vLLM's scheduler
and prefix cache, step times fitted to aiconfigurator-core's H100 data for Llama-3.1-8B, no GPU,
no weights), each on ``--replicas`` replicas that reserve no CPU: ``sim-llama-8b`` with
``routing.affinity: on`` and ``sim-llama-8b-default`` with ``routing.affinity: off`` (the gateway's
power of two choices, Ray Serve's default policy). The same agent load runs through each, one
after the other, on fresh prompts:

- ``--sessions`` agent sessions over ``--tenants`` tenant keys, one hot tenant with half of them;
  each session opens with a ``--prompt-tokens`` prompt (its tenant's system prompt, then its own
  context) and grows by ``--turn-tokens`` a turn (a user message and the reply) for ``--turns``
  turns, every session in flight at once (closed loop), named by Claude Code's session header.

Reported per router: the engines' prefix hit ratio (``ray_vllm_prefix_cache_hits_total`` over
``..._queries_total`` across the model's replicas, Ray's metrics export), TTFT p50 and p95 (wall,
and modelled = wall x time scale), the replica skew (the busiest replica's requests over the mean
of all replicas) and the gateway's CPU seconds; then a probe: another tenant's key replays tenant 0's
first turn, and must get ``cached_tokens`` 0.

EVERY FIGURE HERE IS SIMULATED: the GPUs, their step times and their KV caches are modelled.
The client, the gateway, Ray Serve and the replicas' Python are real and share this machine's
2 cores, so their overhead is in the wall times (and, scaled, in the modelled ones).
Results: ``results/bench/fleet-<stamp>.{json,md,png}`` (``--results-dir``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import resource
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench import procs
from loadtests.bench.affinity import Session, metrics_urls, one_turn, run_load, scrape, settled, words
from loadtests.bench.procs import say
from loadtests.harness import stack as harness
from loadtests.harness.stack import ROOT

AFFINITY, DEFAULT = "sim-llama-8b", "sim-llama-8b-default"
TIER = "bench-unlimited"
CHARS_PER_TOKEN = 4  # the simulated engine's made-up tokenizer (serve_app/engine/sim/tokens.py)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench.fleet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/sim-fleet.yaml")
    p.add_argument("--replicas", type=int, default=8, help="simulated replicas per router")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--tenants", type=int, default=16, help="tenant keys; tenant 0 has half the sessions")
    p.add_argument("--tenant-tokens", type=int, default=2000, help="each tenant's system prompt")
    p.add_argument("--prompt-tokens", type=int, default=30000, help="a session's first prompt")
    p.add_argument("--turn-tokens", type=int, default=500, help="tokens added per turn")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16, help="reply length per turn")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="modelled seconds per wall second (simulated.time_scale)")
    p.add_argument("--load-factor", type=float, default=1.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default=str(ROOT / "results" / "bench"))
    ns = p.parse_args(argv)
    ns.concurrency = ns.sessions  # every session in flight (run_load's workers)
    return ns


def edit_for(ns: argparse.Namespace) -> Any:
    def edit(args: dict[str, Any]) -> None:
        base = next(m for m in args["models"] if m["id"] == AFFINITY)
        on = json.loads(json.dumps(base))
        on["simulated"] = {**on["simulated"], "time_scale": ns.time_scale}
        on["deployment"] = {**on.get("deployment", {}), "num_replicas": ns.replicas}
        off = json.loads(json.dumps(on))
        on["routing"] = {"affinity": "on", "load_factor": ns.load_factor}
        off["id"], off["aliases"], off["routing"] = DEFAULT, [], {"affinity": "off"}
        args["models"] = [on, off]
        args["routes"] = []
        args["tiers"] = {TIER: {"priority": 0, "description": "fleet benchmark: no limits"}}
        args["default_tier"] = TIER
    return edit


def text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` of the simulated engine's tokens of words."""
    out = words(rng, max(1, tokens * CHARS_PER_TOKEN // 6))
    return out[: tokens * CHARS_PER_TOKEN]


def sessions_for(ns: argparse.Namespace, keys: list[str], seed: int) -> list[Session]:
    """Tenant 0 (hot) gets half the sessions, the others the rest round robin."""
    rng = random.Random(seed)
    systems = [f"You are tenant {i}'s coding agent. " + text(rng, ns.tenant_tokens) for i in range(ns.tenants)]
    hot = ns.sessions // 2
    owners = [0] * hot + [1 + i % max(1, ns.tenants - 1) for i in range(ns.sessions - hot)]
    out = [Session(keys[t], t, systems[t] + "\n# session context\n"
                   + text(rng, ns.prompt_tokens - ns.tenant_tokens)) for t in owners]
    rng.shuffle(out)
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(x for x in xs if x == x)
    return s[min(len(s) - 1, int(round(q / 100.0 * (len(s) - 1))))] if s else float("nan")


BUCKET = re.compile(r'^ray_vllm_time_to_first_token_seconds_bucket\{([^}]*)\} ([0-9.eE+-]+)$')


def ttft_buckets(urls: list[str], model: str) -> dict[float, float]:
    """The engines' TTFT histogram (modelled seconds), cumulative counts by upper bound, summed
    over the model's replicas."""
    out: dict[float, float] = {}
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 (the node's own export)
            lines = r.read().decode().splitlines()
        for line in lines:
            m = BUCKET.match(line)
            if not m:
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if labels.get("model_name") == model:
                le = float(labels["le"])
                out[le] = out.get(le, 0.0) + float(m.group(2))
    return out


def quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Prometheus' histogram_quantile over the counts between two scrapes (linear within a
    bucket), in seconds."""
    bounds = sorted(after)
    cum = [after[b] - before.get(b, 0.0) for b in bounds]
    if not cum or cum[-1] <= 0:
        return float("nan")
    rank, lo, prev = q * cum[-1], 0.0, 0.0
    for b, c in zip(bounds, cum, strict=True):
        if c >= rank:
            if b == float("inf"):
                return lo
            return lo + (b - lo) * (rank - prev) / max(1e-12, c - prev)
        lo, prev = b, c
    return lo


def cpu_by_kind(stack: harness.Stack) -> dict[str, float]:
    """CPU seconds so far: the gateway replicas, the model replicas, the rest of the stack (Ray's
    processes, the proxy) and this process (the load client)."""
    out = {"gateway": 0.0, "model replicas": 0.0, "ray and proxy": 0.0}
    for k, v in procs.cpu_seconds(stack.proc.pid).items():
        out["gateway" if ":gateway" in k else "model replicas" if ":model-" in k else "ray and proxy"] += v
    me = resource.getrusage(resource.RUSAGE_SELF)
    out["client"] = me.ru_utime + me.ru_stime
    return out


def one_router(stack: harness.Stack, urls: list[str], model: str, ns: argparse.Namespace,
               keys: list[str], seed: int) -> dict[str, Any]:
    sessions = sessions_for(ns, keys, seed)
    user_tokens = max(1, ns.turn_tokens - ns.max_tokens)
    before, hist0, cpu0, t0 = scrape(urls), ttft_buckets(urls, model), cpu_by_kind(stack), time.monotonic()
    # run_load's user messages are words; about user_tokens of them.
    results = run_load(stack.base_url, model, sessions, ns, max(1, user_tokens * CHARS_PER_TOKEN // 6), seed)
    took, cpu1 = time.monotonic() - t0, cpu_by_kind(stack)
    cpu = {k: round(cpu1[k] - cpu0[k], 1) for k in cpu1}
    after = settled(urls)
    hist = ttft_buckets(urls, model)

    def delta(metric: str) -> dict[str, float]:
        return {r: v - before.get((n, m, r), 0.0) for (n, m, r), v in after.items()
                if n == metric and m == model}

    hits, queries = delta("ray_vllm_prefix_cache_hits_total"), delta("ray_vllm_prefix_cache_queries_total")
    requests = {r: int(v) for r, v in delta("ray_vllm_request_success_total").items() if v}
    counts = sorted(requests.values(), reverse=True)
    ttft = [r["ttft_ms"] for r in results]
    warm = [r["ttft_ms"] for r in results if r["turn"] > 1]
    prompt = sum(r["prompt_tokens"] for r in results)
    return {
        "requests": len(results), "seconds": round(took, 1),
        "hit_ratio": sum(hits.values()) / max(1.0, sum(queries.values())),
        "cached_ratio": sum(r["cached_tokens"] for r in results) / max(1, prompt),
        "prompt_tokens": prompt,
        "ttft_p50_ms": statistics.median(ttft), "ttft_p95_ms": pct(ttft, 95),
        "warm_ttft_p50_ms": statistics.median(warm) if warm else float("nan"),
        "replica_requests": counts,
        # Busiest replica over the mean of all of them (a replica with none counts as 0).
        "skew": counts[0] / (sum(counts) / ns.replicas) if counts else float("nan"),
        # In the engines, modelled: from arrival at the replica's scheduler to the first token.
        "engine_ttft_p50_ms": quantile(hist0, hist, 0.5) * 1000.0,
        "engine_ttft_p95_ms": quantile(hist0, hist, 0.95) * 1000.0,
        "gateway_cpu_s": cpu["gateway"],
        "cpu_s": cpu,
        "cpu_cores": round(sum(cpu.values()) / took, 2),
    }


def probe(stack: harness.Stack, ns: argparse.Namespace, seed: int) -> dict[str, int]:
    """Tenant 0's first turn, then the same prompt and session header from another tenant's key:
    the other tenant must get no cached token (cache_salt); tenant 0's replay is the control."""
    rng = random.Random(seed)
    made = sessions_for(ns, [stack.keys[f"tenant-{i}"] for i in range(ns.tenants)], seed)
    owner = next(x for x in made if x.tenant == 0)
    user = words(rng, 20)
    with httpx.Client(timeout=600) as client:
        one_turn(client, stack.base_url, AFFINITY, Session(owner.key, 0, owner.system, sid=owner.sid),
                 user, ns.max_tokens)
        thief = one_turn(client, stack.base_url, AFFINITY,
                         Session(stack.keys["probe"], -1, owner.system, sid=owner.sid), user, ns.max_tokens)
        own = one_turn(client, stack.base_url, AFFINITY, Session(owner.key, 0, owner.system, sid=owner.sid),
                       user, ns.max_tokens)
    return {"cached_tokens": thief["cached_tokens"], "prompt_tokens": thief["prompt_tokens"],
            "owner_cached_tokens": own["cached_tokens"]}


def markdown(doc: dict[str, Any]) -> str:
    p, r = doc["params"], doc["routers"]
    a, d = r[AFFINITY], r[DEFAULT]
    ts = p["time_scale"]
    lines = [
        "**SIMULATED figures** (serve_app/engine/sim, profile h100-llama3.1-8b fitted to "
        "aiconfigurator-core; no GPU): the GPUs, their step times and KV caches are modelled; the "
        "client, gateway, Ray Serve and replicas are real processes on 2 shared CPU cores.", "",
        f"Command: `{doc['command']}`", "",
        f"{p['replicas']} simulated H100 replicas per router (28,000 KV blocks of 16 tokens each, "
        f"max_num_seqs 256), time scale {ts} (modelled = wall x {ts}); {p['sessions']} agent "
        f"sessions over {p['tenants']} tenants (tenant 0: half of them), each a "
        f"{p['prompt_tokens']}-token first prompt ({p['tenant_tokens']} of them its tenant's) "
        f"growing ~{p['turn_tokens']} tokens a turn for {p['turns']} turns, all sessions in flight; "
        f"replies of {p['max_tokens']} tokens. Skew: busiest replica's requests over the mean of "
        "all replicas. Hit ratio: the engines' prefix-cache counters.", "",
        "Client TTFT: wall time at the client to the first content token, x the time scale. Engine "
        "TTFT: the engines' own histogram (ray_vllm_time_to_first_token_seconds, modelled time from "
        "the replica's scheduler queue to the first token; Prometheus-style quantile within buckets), "
        "so the difference is the client's, the gateway's and Ray Serve's share on this CPU.", "",
        "| Router | Requests | Hit ratio | Cached (answers) | Client TTFT p50 / p95 ms | Engine "
        "TTFT p50 / p95 ms | Warm-turn client TTFT p50 ms | Skew | Requests per replica | "
        "Gateway CPU s | CPU cores used | Run s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for model, label in ((AFFINITY, "affinity"), (DEFAULT, "power of two choices")):
        x = r[model]
        per = " / ".join(str(v) for v in x["replica_requests"])
        lines.append(
            f"| {label} | {x['requests']} | {x['hit_ratio']:.3f} | {x['cached_ratio']:.3f} | "
            f"{x['ttft_p50_ms'] * ts:.0f} / {x['ttft_p95_ms'] * ts:.0f} | "
            f"{x['engine_ttft_p50_ms']:.0f} / {x['engine_ttft_p95_ms']:.0f} | {x['warm_ttft_p50_ms'] * ts:.0f} | "
            f"{x['skew']:.2f} | {per} | {x['gateway_cpu_s']:.1f} | {x['cpu_cores']:.2f} | {x['seconds']:.0f} |")
    pr = doc["probe"]
    lines += [
        "",
        f"- client TTFT affinity/default: p50 {a['ttft_p50_ms'] / d['ttft_p50_ms']:.2f}x, "
        f"p95 {a['ttft_p95_ms'] / d['ttft_p95_ms']:.2f}x; engine TTFT: p50 "
        f"{a['engine_ttft_p50_ms'] / d['engine_ttft_p50_ms']:.2f}x, "
        f"p95 {a['engine_ttft_p95_ms'] / d['engine_ttft_p95_ms']:.2f}x",
        "- CPU seconds by process kind (affinity / default): "
        + ", ".join(f"{k} {a['cpu_s'][k]:.1f} / {d['cpu_s'][k]:.1f}" for k in a["cpu_s"]),
        f"- gateway CPU: {a['gateway_cpu_s']:.1f} s / {d['gateway_cpu_s']:.1f} s over "
        f"{a['seconds']:.0f} s / {d['seconds']:.0f} s runs "
        f"({a['gateway_cpu_s'] / max(1.0, a['seconds']):.2f} / {d['gateway_cpu_s'] / max(1.0, d['seconds']):.2f} cores)",
        f"- probe (another tenant's key replaying tenant 0's prompt with its session header): "
        f"cached_tokens {pr['cached_tokens']} of {pr['prompt_tokens']}; tenant 0's own replay: "
        f"{pr['owner_cached_tokens']} cached",
    ]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r, ts = doc["routers"], doc["params"]["time_scale"]
    sides = ((AFFINITY, "affinity router"), (DEFAULT, "power of two choices"))
    panels: tuple[tuple[str, list[str], float], ...] = (
        ("prefix hit ratio (engines' counters)", ["hit_ratio"], 1.0),
        ("TTFT ms (client, modelled)", ["ttft_p50_ms", "ttft_p95_ms"], ts),
        ("skew: busiest replica / mean", ["skew"], 1.0))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (title, names, scale) in zip(axes, panels, strict=True):
        ticks = [n.removesuffix("_ms").replace("_", " ") for n in names]
        for j, (model, label) in enumerate(sides):
            ys = [float(r[model][n]) * scale for n in names]
            ax.bar([i + (j - 0.5) * 0.4 for i in range(len(ys))], ys, 0.4, label=label)
        ax.set_xticks(range(len(ticks)), ticks)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    p = doc["params"]
    fig.suptitle(f"SIMULATED: {p['replicas']} H100 replicas of Llama-3.1-8B per router, {p['sessions']} "
                 f"sessions of {p['prompt_tokens'] // 1000}k-token prompts, {p['turns']} turns", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


SCENARIOS = ("affinity", "fairness", "all")


def main(argv: list[str] | None = None) -> int:
    """``--scenario affinity`` (the default: this module's options), ``fairness``
    (loadtests/bench/fleet_fairness.py and its options) or ``all`` (each with its defaults)."""
    pick = argparse.ArgumentParser(add_help=False)
    pick.add_argument("--scenario", choices=SCENARIOS, default="affinity")
    chosen, rest = pick.parse_known_args(sys.argv[1:] if argv is None else argv)
    if chosen.scenario == "fairness":
        from loadtests.bench import fleet_fairness

        return fleet_fairness.main(rest)
    if chosen.scenario == "all":
        from loadtests.bench import fleet_fairness

        both = argparse.ArgumentParser(prog="python -m loadtests.bench.fleet --scenario all")
        both.add_argument("--results-dir")
        both.add_argument("--seed")
        got = both.parse_args(rest)  # each scenario with its own defaults, only these shared
        common = [a for k, v in vars(got).items() if v is not None
                  for a in (f"--{k.replace('_', '-')}", v)]
        return max(affinity_main(common), fleet_fairness.main(common))
    return affinity_main(rest)


def affinity_main(argv: list[str]) -> int:
    ns = parse_args(argv)
    run = procs.new_run("fleet", "loadtests.bench.fleet", ns.config, ns.results_dir, argv)
    workdir = Path(tempfile.mkdtemp(prefix="serve-app-fleet-"))
    keys = {f"tenant-{i}": (TIER, ["*"]) for i in range(ns.tenants)} | {"probe": (TIER, ["*"])}
    stack = harness.start_stack(run.config, workdir, edit=edit_for(ns), retries=1, say=say, keys=keys)
    try:
        procs.require_loopback(stack.base_url)
        urls = metrics_urls(stack)
        say(f"engine metrics from {urls}")
        tk = [stack.keys[f"tenant-{i}"] for i in range(ns.tenants)]
        routers: dict[str, Any] = {}
        for i, model in enumerate((AFFINITY, DEFAULT)):
            routers[model] = one_router(stack, urls, model, ns, tk, ns.seed * 10 + i)
            say(f"{model}: {json.dumps(routers[model])}")
        found = probe(stack, ns, ns.seed * 10 + 7)
        say(f"probe: {found}")
    finally:
        stack.stop(say=say)
    doc = {"command": run.command, "timestamp": run.stamp, "simulated": True,
           "params": {k: v for k, v in vars(ns).items() if k not in ("results_dir", "config")},
           "routers": routers, "probe": found}
    procs.write_results(run.base, doc, markdown(doc))
    say(f"wrote {plot(doc, run.base.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
