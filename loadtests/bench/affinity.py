"""Agent sessions over two model replicas: the affinity router against power of two choices.

``python -m loadtests.bench.affinity`` (``make bench-affinity``) starts one stack with two copies of
``tiny-chat``, each with two replicas whose KV cache is capped (``--kv-mib``, so one replica holds
only part of the working set): ``tiny-chat`` with ``routing.affinity: on`` and ``tiny-chat-default``
with ``routing.affinity: off`` (the gateway's power of two choices, Ray Serve's default policy). The same load runs through each:

- **even**: 8 tenant keys x 2 sessions; each session a ~1,024-token tenant system prompt plus 12
  agent turns (~64 tokens more per turn: the reply and a new user message), the session named by
  Claude Code's ``X-Claude-Code-Session-Id`` header; the turns of all sessions interleave at
  concurrency 4 (a session's next turn waits for its previous one);
- **hot**: one tenant sends ~70 % of the turns (16 sessions against one each for the other 7).

Reported per model and load: the engines' prefix-cache hit ratio (sum of ``vllm:prefix_cache_hits``
over sum of ``vllm:prefix_cache_queries`` across the model's replicas, from Ray's metrics export;
and the same from the answers' ``cached_tokens``), client TTFT p50, and the request skew between
replicas (max/min of ``vllm:request_success`` per replica). Then a **probe**: another tenant's key
replays tenant 0's first turn, with the same session header; its ``cached_tokens`` must be 0.

On this machine the four engines share 2 cores (``VLLM_CPU_OMP_THREADS_BIND=nobind``, one OpenMP
thread each), and the loads run one at a time. Results: ``results/bench/affinity-<stamp>.{json,md,png}``.
Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench import procs
from loadtests.bench.procs import say
from loadtests.harness import stack as harness
from loadtests.harness.stack import ROOT, descendants

AFFINITY, DEFAULT = "tiny-chat", "tiny-chat-default"
TIER = "bench-unlimited"
TENANTS = 8
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu file edit "
         "read write test build diff patch function class module import return value").split()
SAMPLE = re.compile(r'^(ray_vllm_[a-z_]+_total|ray_serve_app_routing_decisions_total)'
                    r'\{([^}]*)\} ([0-9.eE+-]+)$')


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench.affinity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--prefix-tokens", type=int, default=1024, help="tenant system prompt (tokens)")
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--turn-tokens", type=int, default=64, help="tokens added per turn")
    p.add_argument("--sessions", type=int, default=2, help="sessions per tenant (even load)")
    p.add_argument("--hot-sessions", type=int, default=16, help="the hot tenant's sessions")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8, help="reply length per turn")
    p.add_argument("--kv-mib", type=int, default=16,
                   help="KV cache per replica (MiB; 1 KiB/token): about 3/4 of the even load's working set")
    p.add_argument("--block-size", type=int, default=32,
                   help="KV block size, both models (vLLM's CPU default is 128: a turn's ~64 new "
                        "tokens then leave up to 127 more uncached)")
    p.add_argument("--load-factor", type=float, default=1.25)
    p.add_argument("--repeats", type=int, default=3, help="runs of each load and router (medians)")
    p.add_argument("--results-dir", default=str(ROOT / "results" / "bench"))
    return p.parse_args(argv)


def edit_for(ns: argparse.Namespace) -> Any:
    def edit(args: dict[str, Any]) -> None:
        """Two copies of tiny-chat, two replicas each, KV capped; one with the affinity router."""
        base = next(m for m in args["models"] if m["id"] == AFFINITY)
        on = json.loads(json.dumps(base))
        on["engine"] = {**on.get("engine", {}), "enable_prefix_caching": True,
                        "kv_cache_memory_bytes": ns.kv_mib * 1024 * 1024, "max_model_len": 8192,
                        "block_size": ns.block_size}
        on["deployment"] = {**on.get("deployment", {}), "num_replicas": 2}
        # Two engines per model on 2 cores: let the OS place their one OpenMP thread each.
        on["env"] = {**on.get("env", {}), "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
        on.pop("admission", None)
        off = json.loads(json.dumps(on))
        on["routing"] = {"affinity": "on", "load_factor": ns.load_factor}
        off["id"], off["aliases"], off["routing"] = DEFAULT, [], {"affinity": "off"}
        args["models"] = [on, off]
        args["routes"] = []
        args["tiers"] = {TIER: {"priority": 0, "description": "affinity benchmark: no limits"}}
        args["default_tier"] = TIER
    return edit


# ---- the engines' counters -------------------------------------------------------------------------
def metrics_urls(stack: harness.Stack) -> list[str]:
    """Ray's metrics export of the stack's node(s): the raylet names its session directory."""
    address = stack.ray_address() or "127.0.0.1:0"
    node_ip = address.rsplit(":", 1)[0]
    session = None
    for pid in descendants(stack.proc.pid):
        for arg in harness.cmdline(pid):
            if arg.startswith(("--session_dir=", "--session-dir=")):
                session = Path(arg.split("=", 1)[1])
    session = session or Path("/tmp/ray/session_latest")
    return [f"http://{node_ip}:{int(p.read_text().strip())}/metrics"
            for p in sorted(session.glob("metrics_export_port_*"))]


# (metric, model_name, ReplicaId) -> value; for the router's decisions (metric, model, decision)
Counters = dict[tuple[str, str, str], float]


def scrape(urls: list[str]) -> Counters:
    out: Counters = defaultdict(float)
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 (the node's own export)
            text = r.read().decode()
        for line in text.splitlines():
            m = SAMPLE.match(line)
            if not m or m.group(1) not in ("ray_vllm_prefix_cache_hits_total",
                                           "ray_vllm_prefix_cache_queries_total",
                                           "ray_vllm_request_success_total",
                                           "ray_serve_app_routing_decisions_total"):
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            if m.group(1) == "ray_serve_app_routing_decisions_total":  # (metric, model, decision)
                model = labels["deployment"].removeprefix("model-")
                out[(m.group(1), model, labels.get("decision", ""))] += float(m.group(3))
                continue
            out[(m.group(1), labels.get("model_name", ""), labels.get("ReplicaId", ""))] += float(m.group(3))
    return dict(out)


def settled(urls: list[str], min_wait_s: float = 12.0) -> Counters:
    """The counters once Ray's export has caught up (it reports every few seconds): unchanged
    across two reads, at least ``min_wait_s`` after the load."""
    time.sleep(min_wait_s)
    last = scrape(urls)
    for _ in range(15):
        time.sleep(3)
        now = scrape(urls)
        if now == last:
            return now
        last = now
    return last


def engine_view(before: Counters, after: Counters, model: str) -> dict[str, Any]:
    def delta(metric: str) -> dict[str, float]:
        per: dict[str, float] = defaultdict(float)
        for (name, m, replica), v in after.items():
            if name == metric and m == model:
                per[replica] += v - before.get((name, m, replica), 0.0)
        return dict(per)
    hits, queries = delta("ray_vllm_prefix_cache_hits_total"), delta("ray_vllm_prefix_cache_queries_total")
    requests = {r: int(v) for r, v in delta("ray_vllm_request_success_total").items()}
    decisions = {d: int(v) for d, v in delta("ray_serve_app_routing_decisions_total").items() if v}
    counts = sorted(requests.values())
    return {
        "hit_ratio": sum(hits.values()) / max(1.0, sum(queries.values())),
        "replica_hit_ratio": {r: hits.get(r, 0.0) / max(1.0, q) for r, q in queries.items()},
        "replica_requests": requests,
        "skew": (counts[-1] / max(1, counts[0])) if len(counts) >= 2 else float("inf"),
        "decisions": decisions,
    }


# ---- the load ---------------------------------------------------------------------------------------
@dataclass
class Session:
    key: str
    tenant: int
    system: str
    sid: str = field(default_factory=lambda: str(uuid.uuid4()))
    messages: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def tokens_of(client: httpx.Client, root: str, key: str, text: str) -> int:
    r = client.post(f"{root}/tokenize", headers={"Authorization": f"Bearer {key}"},
                    json={"model": AFFINITY, "prompt": text})
    r.raise_for_status()
    return int(r.json()["count"])


def stream_chat(client: httpx.Client, base_url: str, body: dict[str, Any],
                headers: dict[str, str]) -> tuple[float, str, dict[str, Any]]:
    """One streamed chat completion: the TTFT in ms (to the first content; nan without one), the
    text, and the usage chunk (empty without one). A status other than 200 raises."""
    t0 = time.monotonic()
    ttft = float("nan")
    text: list[str] = []
    usage: dict[str, Any] = {}
    with client.stream("POST", f"{base_url}/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{body.get('model')}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            doc = json.loads(line[6:])
            for choice in doc.get("choices") or []:
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    if not text:
                        ttft = (time.monotonic() - t0) * 1000.0
                    text.append(delta)
            if doc.get("usage"):
                usage = doc["usage"]
    return ttft, "".join(text), usage


def one_turn(client: httpx.Client, base_url: str, model: str, s: Session, user: str,
             max_tokens: int) -> dict[str, Any]:
    """One streamed agent turn; the reply joins the session's history."""
    messages = [{"role": "system", "content": s.system}, *s.messages, {"role": "user", "content": user}]
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}, "messages": messages}
    headers = {"Authorization": f"Bearer {s.key}", "X-Claude-Code-Session-Id": s.sid}
    ttft, text, usage = stream_chat(client, base_url, body, headers)
    s.messages += [{"role": "user", "content": user}, {"role": "assistant", "content": text}]
    s.turn += 1
    details = usage.get("prompt_tokens_details") or {}
    return {"tenant": s.tenant, "turn": s.turn, "ttft_ms": ttft,
            "prompt_tokens": int(usage.get("prompt_tokens") or 0),
            "cached_tokens": int(details.get("cached_tokens") or 0)}


def run_load(base_url: str, model: str, sessions: list[Session], ns: argparse.Namespace,
             user_words: int, seed: int) -> list[dict[str, Any]]:
    """Every session's turns, interleaved round-robin over ``ns.concurrency`` workers: a worker
    takes the next session whose previous turn is done."""
    ready = list(sessions)
    lock = threading.Lock()
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    rng = random.Random(seed)
    users = {id(s): [words(rng, user_words) for _ in range(ns.turns)] for s in sessions}

    def worker() -> None:
        with httpx.Client(timeout=300) as client:
            while True:
                with lock:
                    if errors or not ready:
                        if not any(s.turn < ns.turns for s in sessions) or errors:
                            return
                        s = None
                    else:
                        s = ready.pop(0)
                if s is None:
                    time.sleep(0.01)
                    continue
                try:
                    r = one_turn(client, base_url, model, s, users[id(s)][s.turn], ns.max_tokens)
                except BaseException as exc:  # reported after the join
                    with lock:
                        errors.append(exc)
                    return
                with lock:
                    results.append(r)
                    if s.turn < ns.turns:
                        ready.append(s)

    threads = [threading.Thread(target=worker) for _ in range(ns.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def client_view(results: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(r["prompt_tokens"] for r in results)
    return {"requests": len(results),
            "ttft_p50_ms": statistics.median(r["ttft_ms"] for r in results),
            "ttft_p90_ms": statistics.quantiles([r["ttft_ms"] for r in results], n=10)[-1],
            "cached_ratio": sum(r["cached_tokens"] for r in results) / max(1, prompt),
            "prompt_tokens": prompt}


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One figure per measure over the repeats: the median of each ratio and time; requests and
    router decisions summed. The repeats themselves stay in ``runs``."""
    def med(part: str, name: str) -> float:
        return float(statistics.median(r[part][name] for r in runs))

    replicas: dict[str, int] = defaultdict(int)
    decisions: dict[str, int] = defaultdict(int)
    for r in runs:
        for i, n in enumerate(sorted(r["engine"]["replica_requests"].values(), reverse=True)):
            replicas[f"rank{i}"] += n
        for d, n in r["engine"]["decisions"].items():
            decisions[d] += n
    return {
        "engine": {"hit_ratio": med("engine", "hit_ratio"), "skew": med("engine", "skew"),
                   "replica_requests": dict(replicas), "decisions": dict(decisions)},
        "client": {"requests": sum(r["client"]["requests"] for r in runs),
                   "ttft_p50_ms": med("client", "ttft_p50_ms"), "ttft_p90_ms": med("client", "ttft_p90_ms"),
                   "cached_ratio": med("client", "cached_ratio")},
        "seconds": sum(r["seconds"] for r in runs),
        "runs": runs,
    }


# ---- report -------------------------------------------------------------------------------------------
def replay_probe(stack: harness.Stack, ns: argparse.Namespace, sessions: list[Session]) -> dict[str, int]:
    """Another tenant's key replays tenant 0's first turn with its session header: no cached token
    (its cache_salt differs). Then tenant 0's own key replays it: cached (the control)."""
    victim = next(s for s in sessions if s.tenant == 0)
    first_user = victim.messages[0]["content"]
    with httpx.Client(timeout=300) as client:
        thief = Session(stack.keys["probe"], -1, victim.system, sid=victim.sid)
        stolen = one_turn(client, stack.base_url, AFFINITY, thief, first_user, ns.max_tokens)
        owner = Session(victim.key, 0, victim.system, sid=victim.sid)
        own = one_turn(client, stack.base_url, AFFINITY, owner, first_user, ns.max_tokens)
    return {"cached_tokens": stolen["cached_tokens"], "prompt_tokens": stolen["prompt_tokens"],
            "owner_cached_tokens": own["cached_tokens"]}


def markdown(doc: dict[str, Any]) -> str:
    p = doc["params"]
    lines = [
        f"Command: `{doc['command']}`", "",
        f"Two replicas per model, KV cache {p['kv_mib']} MiB per replica (about {p['kv_mib'] * 1024} "
        f"tokens, blocks of {p.get('block_size', 128)}); {TENANTS} tenant keys; each session a {p['prefix_tokens']}-token tenant prompt "
        f"plus {p['turns']} turns (~{p['turn_tokens']} tokens more each, Claude Code's session "
        f"header), concurrency {p['concurrency']}. Four engines share this machine's 2 cores; "
        f"loads run one at a time, {p['repeats']} repeats with the routers' order alternating, each "
        "repeat with fresh prompts; every figure is the median of the repeats (requests and "
        "decisions summed; requests per replica summed by rank). Hit ratio: vLLM's prefix-cache counters (hits/queries) over the "
        "model's replicas; cached: the answers' cached_tokens over prompt tokens; skew: max/min "
        "requests per replica (vLLM's request_success).", "",
        "| Load | Router | Requests | Hit ratio (vLLM counters) | Cached (answers) | TTFT p50 ms | "
        "TTFT p90 ms | Skew max/min | Requests per replica | Router decisions |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for load in ("even", "hot"):
        for model, label in ((AFFINITY, "affinity"), (DEFAULT, "power of two choices")):
            r = doc["loads"][load][model]
            e, c = r["engine"], r["client"]
            per = " / ".join(str(v) for v in sorted(e["replica_requests"].values(), reverse=True))
            decided = ", ".join(f"{k} {v}" for k, v in sorted(e["decisions"].items())) or "-"
            lines.append(f"| {load} | {label} | {c['requests']} | {e['hit_ratio']:.3f} | "
                         f"{c['cached_ratio']:.3f} | {c['ttft_p50_ms']:.0f} | {c['ttft_p90_ms']:.0f} | "
                         f"{e['skew']:.2f} | {per} | {decided} |")
    lines += [""]
    for load in ("even", "hot"):
        a, d = doc["loads"][load][AFFINITY], doc["loads"][load][DEFAULT]
        lines.append(f"- {load}: TTFT p50 affinity/default = "
                     f"{a['client']['ttft_p50_ms'] / d['client']['ttft_p50_ms']:.2f}x")
    probe = doc["probe"]
    lines += [f"- probe (another tenant's key replaying tenant 0's first turn, same session header): "
              f"cached_tokens {probe['cached_tokens']} of {probe['prompt_tokens']} prompt tokens; "
              f"tenant 0's own replay: {probe['owner_cached_tokens']} cached"]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = ["even", "hot"]
    sides = ((AFFINITY, "affinity router"), (DEFAULT, "power of two choices"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    metrics = (("hit ratio (vLLM counters)", "engine", "hit_ratio"),
               ("TTFT p50, ms", "client", "ttft_p50_ms"),
               ("request skew max/min", "engine", "skew"))
    for ax, (title, part, name) in zip(axes, metrics, strict=True):
        for j, (model, label) in enumerate(sides):
            xs = [i + (j - 0.5) * 0.4 for i in range(len(loads))]
            ax.bar(xs, [doc["loads"][ld][model][part][name] for ld in loads], 0.4, label=label)
        ax.set_xticks(range(len(loads)), ["8 tenants x 2 sessions", "hot tenant 70 %"])
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("2 replicas of tiny-chat, KV capped, 2 shared cores: affinity vs default routing",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    run = procs.new_run("affinity", "loadtests.bench.affinity", ns.config, ns.results_dir, argv)
    workdir = Path(tempfile.mkdtemp(prefix="serve-app-affinity-"))
    keys = {f"tenant-{i}": (TIER, ["*"]) for i in range(TENANTS)} | {"probe": (TIER, ["*"])}
    stack = harness.start_stack(run.config, workdir, edit=edit_for(ns), retries=1, say=say, keys=keys)
    try:
        procs.require_loopback(stack.base_url)
        urls = metrics_urls(stack)
        say(f"engine metrics from {urls}")
        tk = [stack.keys[f"tenant-{i}"] for i in range(TENANTS)]
        with httpx.Client(timeout=300) as client:
            per_word = tokens_of(client, stack.root_url, tk[0], words(random.Random(0), 400)) / 400
        prefix_words = max(1, int(ns.prefix_tokens / per_word))
        user_words = max(1, int((ns.turn_tokens - ns.max_tokens) / per_word))
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {
            ld: {AFFINITY: [], DEFAULT: []} for ld in ("even", "hot")}
        probe: dict[str, int] = {}
        for rep in range(ns.repeats):
            # The order alternates between repeats, so neither router always runs right after the
            # other (whose engines keep spinning for about a second after their last request).
            order = (AFFINITY, DEFAULT) if rep % 2 == 0 else (DEFAULT, AFFINITY)
            for li, load in enumerate(("even", "hot")):
                for model in order:
                    mi = (AFFINITY, DEFAULT).index(model)
                    seed = 1000 * rep + 100 * li + mi  # fresh prompts per repeat, load and model
                    rng = random.Random(seed)
                    systems = [f"You are tenant {i}'s coding agent. " + words(rng, prefix_words)
                               for i in range(TENANTS)]
                    counts = ([ns.sessions] * TENANTS if load == "even"
                              else [ns.hot_sessions] + [1] * (TENANTS - 1))
                    sessions = [Session(tk[i], i, systems[i])
                                for i in range(TENANTS) for _ in range(counts[i])]
                    random.Random(seed).shuffle(sessions)
                    before = scrape(urls)
                    t0 = time.monotonic()
                    results = run_load(stack.base_url, model, sessions, ns, user_words, seed)
                    took = time.monotonic() - t0
                    after = settled(urls)
                    one = {"engine": engine_view(before, after, model),
                           "client": client_view(results), "seconds": round(took, 1)}
                    runs[load][model].append(one)
                    say(f"repeat {rep + 1}/{ns.repeats} {load} {model}: {json.dumps(one)}")
                    if rep == 0 and load == "even" and model == AFFINITY:
                        probe = replay_probe(stack, ns, sessions)
                        say(f"probe: {probe}")
        loads = {ld: {m: combine(rs) for m, rs in per.items()} for ld, per in runs.items()}
    finally:
        stack.stop(say=say)
    doc = {"command": run.command, "timestamp": run.stamp,
           "params": {k: v for k, v in vars(ns).items() if k not in ("results_dir", "config")},
           "per_word_tokens": per_word, "loads": loads, "probe": probe}
    procs.write_results(run.base, doc, markdown(doc))
    png = plot(doc, run.base.with_suffix(".png"))
    say(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
