"""Many LoRA adapters over two replicas: adapter-aware routing against power of two choices.

``python -m loadtests.bench.lora_routing`` (``make bench-lora``, issue 41) builds 16 distinct tiny
LoRA adapters for ``tiny-chat`` (``serve-app build-tiny-lora``: seeds after the builtin
``tiny-chat-pirate``'s, the same recipe) into a temporary folder, and starts one stack with
two copies of ``tiny-chat``, each with two replicas and the 16 adapters under names of its own,
``engine.max_loras`` 4 (and ``max_cpu_loras`` 4, vLLM's default: an adapter that leaves the CPU
cache is read from disk again):

- ``tiny-chat`` with ``routing.affinity: on``: the gateway's affinity router, where a request for an
  adapter takes the adapter as its affinity key (``gateway.routing.affinity.adapter_affinity``), so
  each adapter has a home replica, under the router's load guard;
- ``tiny-chat-default`` with ``routing.affinity: off``: power of two choices, Ray Serve's default
  policy, which ignores where an adapter is resident.

The same load runs through each, one at a time: a closed loop of ``--users`` clients, each sending
a ~64-token prompt for 16 output tokens (greedy, streamed) to an adapter drawn from a Zipf
distribution (s 1.1) over the 16, from a seeded generator per client, so both routers see the same
sequence of adapters per client. Reported per router: client TTFT p50 and p95, output tokens/s,
and adapter loads per 1,000 requests.

**Adapter loads are counted from vLLM's own log lines.** vLLM exports no counter of them
(``vllm:lora_requests_info`` is a gauge of the running and waiting adapters). Its LoRA manager
(``vllm/lora/model_manager.py``) logs at DEBUG ``Activating LoRA. int id: N, slot index: M`` each
time an adapter is moved into one of the ``max_loras`` slots of the engine (a *slot load*: the unit
issue 41 asks for), and ``Adding lora. Model id: N ...`` each time the worker has read one from disk
into its CPU cache (``vllm/lora/worker_manager.py``, ``LRUCacheWorkerLoRAManager.add_adapter``).
Each model copy gets a logging config (``VLLM_LOGGING_CONFIG_PATH``) that keeps vLLM's usual INFO
output and adds those two DEBUG loggers' records, with the engine process's pid, to a file of its
own; the bench counts the lines added during each load (``count_lora_events``).

Traffic goes to 127.0.0.1 only. Results: ``results/bench/lora-routing-<stamp>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import math
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench import affinity, procs
from loadtests.bench.procs import say
from loadtests.harness import stack as harness
from loadtests.harness.stack import ROOT

AWARE, DEFAULT = "tiny-chat", "tiny-chat-default"
MODELS = (AWARE, DEFAULT)
LABELS = {AWARE: "adapter-aware (affinity router)", DEFAULT: "default (power of two choices)"}
TIER = "bench-unlimited"
BUILTIN_SEED = 4321  # tiny-chat-pirate's (serve_app/engine/tiny_lora.py); the bench's adapters follow it
# The targets: adapter-aware over default.
TARGET_TTFT_P50 = 0.6
TARGET_LOADS = 0.25

# vLLM's LoRA log lines (vllm/lora/model_manager.py), as the logging config below writes them:
# "<pid> <logger> <message>".
EVENTS = {
    "slot": re.compile(r"Activating LoRA\. int id: (\d+), slot index: (\d+)"),
    "disk": re.compile(r"Adding lora\. Model id: (\d+), int id: (\d+)"),
}
LINE = re.compile(r"^(\d+) (\S+) (.*)$")
LORA_LOGGER = "vllm.lora.model_manager"


# ---- adapters and their popularity ------------------------------------------------------------------
def adapter_names(model: str, n: int) -> list[str]:
    """The ``n`` adapters' names on one model copy: unique across the stack, rank order (the first
    is the most popular)."""
    return [f"{model}-lora-{i:02d}" for i in range(n)]


def build_adapters(folder: Path, n: int) -> list[Path]:
    """``n`` distinct tiny LoRAs for tiny-chat, by the public ``serve-app build-tiny-lora`` (seeds
    after the builtin adapter's, 4321)."""
    argv = [*harness.CLI, "build-tiny-lora", "--out", str(folder), "--count", str(n),
            "--seed", str(BUILTIN_SEED + 1)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    paths = [Path(line) for line in done.stdout.split()]
    if done.returncode != 0 or len(paths) != n:
        raise SystemExit(f"serve-app build-tiny-lora failed ({done.returncode}): "
                         f"{(done.stderr or done.stdout).strip()[-2000:]}")
    return paths


def zipf_weights(n: int, s: float) -> list[float]:
    """P(rank k) for k = 1..n, proportional to 1 / k**s."""
    raw = [1.0 / (k ** s) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


class ZipfSampler:
    """Draws adapter indexes 0..n-1 (0 the most popular) from a Zipf distribution, seeded: the same
    seed gives the same sequence, whatever runs in between."""

    def __init__(self, n: int, s: float, seed: int) -> None:
        self.cum = list(itertools.accumulate(zipf_weights(n, s)))
        self.rng = random.Random(seed)

    def __call__(self) -> int:
        return min(bisect.bisect_left(self.cum, self.rng.random() * self.cum[-1]), len(self.cum) - 1)


# ---- counting adapter loads ---------------------------------------------------------------------------
def logging_config(log_file: Path) -> dict[str, Any]:
    """vLLM's logging config (``VLLM_LOGGING_CONFIG_PATH``, which replaces vLLM's default): vLLM's
    INFO output to stdout as usual, plus the LoRA manager's DEBUG records to ``log_file``."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "vllm": {"format": "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"},
            "lora": {"format": "%(process)d %(name)s %(message)s"},
        },
        "handlers": {
            "vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "INFO",
                     "stream": "ext://sys.stdout"},
            "lora": {"class": "logging.FileHandler", "formatter": "lora", "level": "DEBUG",
                     "filename": str(log_file), "mode": "a"},
        },
        "loggers": {
            "vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
            LORA_LOGGER: {"handlers": ["lora"], "level": "DEBUG", "propagate": True},
        },
    }


def count_lora_events(text: str) -> dict[str, Counter[str]]:
    """Per event kind (``slot``, ``disk``), the count per engine process (pid) in a LoRA log."""
    out: dict[str, Counter[str]] = {kind: Counter() for kind in EVENTS}
    for line in text.splitlines():
        m = LINE.match(line)
        if not m or m.group(2) != LORA_LOGGER:
            continue
        for kind, pattern in EVENTS.items():
            if pattern.search(m.group(3)):
                out[kind][m.group(1)] += 1
    return out


class LoraLog:
    """One model copy's LoRA log: the events added since ``mark``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def mark(self) -> None:
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def since_mark(self) -> dict[str, Counter[str]]:
        if not self.path.exists():
            return count_lora_events("")
        with self.path.open("rb") as f:
            f.seek(self.offset)
            text = f.read().decode(errors="replace")
        # A line still being written is counted next time (it has no newline yet).
        return count_lora_events(text[: text.rfind("\n") + 1])


# ---- the stack ------------------------------------------------------------------------------------------
def edit_for(ns: argparse.Namespace, folders: list[Path], log_configs: dict[str, Path]) -> Any:
    def edit(args: dict[str, Any]) -> None:
        """Two copies of tiny-chat, two replicas each, the adapters on both; one adapter-aware."""
        base = next(m for m in args["models"] if m["id"] == AWARE)
        copies = []
        for model in MODELS:
            m = json.loads(json.dumps(base))
            m["id"], m["aliases"] = model, []
            m["adapters"] = [{"name": name, "source": str(path)}
                             for name, path in zip(adapter_names(model, ns.adapters), folders, strict=True)]
            m["engine"] = {**m.get("engine", {}), "enable_lora": True, "max_loras": ns.max_loras,
                           "max_cpu_loras": ns.max_cpu_loras, "max_lora_rank": 8,
                           "max_model_len": 4096, "kv_cache_memory_bytes": ns.kv_mib * 1024 * 1024}
            m["deployment"] = {**m.get("deployment", {}), "num_replicas": ns.replicas}
            # Four engines on 2 cores: let the OS place their one OpenMP thread each.
            m["env"] = {**m.get("env", {}), "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                        "VLLM_LOGGING_CONFIG_PATH": str(log_configs[model])}
            m.pop("admission", None)
            routing: dict[str, Any] = {"affinity": "on" if model == AWARE else "off"}
            if model == AWARE and ns.load_factor is not None:
                routing["load_factor"] = ns.load_factor
            m["routing"] = routing
            copies.append(m)
        args["models"] = copies
        args["routes"] = []
        args["tiers"] = {TIER: {"priority": 0, "description": "LoRA routing benchmark: no limits"}}
        args["default_tier"] = TIER
    return edit


# ---- the load -------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    adapter: int
    ttft_ms: float
    completion_tokens: int
    error: str = ""


def one_request(client: httpx.Client, base_url: str, key: str, model: str, prompt: str,
                max_tokens: int) -> tuple[float, int]:
    """One streamed chat completion: (TTFT ms, completion tokens)."""
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": prompt}]}
    ttft, _, usage = affinity.stream_chat(client, base_url, body, {"Authorization": f"Bearer {key}"})
    return ttft, int(usage.get("completion_tokens") or 0)


def run_load(base_url: str, key: str, model: str, ns: argparse.Namespace, prompt_words: int,
             seed: int) -> tuple[list[Outcome], float]:
    """``ns.users`` closed-loop clients for ``ns.duration`` seconds (requests in flight then finish):
    the outcomes and the wall time from the first request to the last answer. Client ``u`` draws
    its adapters and prompts from seed ``seed * 1000 + u``: the same for both routers."""
    names = adapter_names(model, ns.adapters)
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    stop_at = t0 + ns.duration

    def user(u: int) -> None:
        sample = ZipfSampler(ns.adapters, ns.zipf_s, seed * 1000 + u)
        rng = random.Random(seed * 1000 + u + 500)
        with httpx.Client(timeout=300) as client:
            while time.monotonic() < stop_at:
                a = sample()
                prompt = f"Client {u} asks: " + affinity.words(rng, prompt_words)
                try:
                    ttft, tokens = one_request(client, base_url, key, names[a], prompt, ns.max_tokens)
                    out = Outcome(a, ttft, tokens)
                except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                    out = Outcome(a, math.nan, 0, str(exc)[:300])
                    time.sleep(0.5)
                with lock:
                    outcomes.append(out)

    threads = [threading.Thread(target=user, args=(u,)) for u in range(ns.users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes, time.monotonic() - t0


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between the closest ranks; nan when empty."""
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(outcomes: list[Outcome], seconds: float, events: dict[str, Counter[str]],
              n_adapters: int) -> dict[str, Any]:
    """One router's figures: client TTFT, throughput and adapter loads per 1,000 requests."""
    ok = [o for o in outcomes if not o.error]
    requests = len(ok)
    slot, disk = sum(events["slot"].values()), sum(events["disk"].values())
    per_adapter = Counter(o.adapter for o in ok)
    return {
        "requests": requests,
        "failed": len(outcomes) - requests,
        "errors": sorted({o.error for o in outcomes if o.error})[:3],
        "seconds": round(seconds, 1),
        "ttft_p50_ms": percentile([o.ttft_ms for o in ok], 50),
        "ttft_p95_ms": percentile([o.ttft_ms for o in ok], 95),
        "output_tok_s": sum(o.completion_tokens for o in ok) / seconds if seconds > 0 else 0.0,
        "slot_loads": slot,
        "disk_loads": disk,
        "slot_loads_per_1k": 1000.0 * slot / max(1, requests),
        "disk_loads_per_1k": 1000.0 * disk / max(1, requests),
        "slot_loads_per_engine": sorted(events["slot"].values(), reverse=True),
        "requests_per_adapter": [per_adapter.get(i, 0) for i in range(n_adapters)],
    }


# ---- report ---------------------------------------------------------------------------------------------
def ratios(doc: dict[str, Any]) -> dict[str, float]:
    """Adapter-aware over default, for the issue's two targets (and throughput)."""
    a, d = doc["routers"][AWARE], doc["routers"][DEFAULT]

    def over(name: str) -> float:
        return a[name] / d[name] if d[name] else math.nan
    return {"ttft_p50": over("ttft_p50_ms"), "slot_loads_per_1k": over("slot_loads_per_1k"),
            "output_tok_s": over("output_tok_s")}


def verdict(ratio: float, target: float) -> str:
    return "MET" if ratio <= target else "MISSED"


def markdown(doc: dict[str, Any]) -> str:
    p = doc["params"]
    lines = [
        f"Command: `{doc['command']}`", "",
        f"REAL vLLM CPU engines: two copies of tiny-chat in one stack, {p['replicas']} replicas each, "
        f"{p['adapters']} tiny LoRA adapters (rank 8) on each, max_loras {p['max_loras']}, "
        f"max_cpu_loras {p['max_cpu_loras']}. A closed loop of {p['users']} clients for "
        f"{p['duration']:.0f} s per router, one router at a time; prompts of ~{p['prompt_tokens']} "
        f"tokens, {p['max_tokens']} output tokens (greedy, streamed); adapters drawn from a Zipf "
        f"distribution (s {p['zipf_s']}, seed {p['seed']}, the same sequence per client for both "
        "routers). Four engines share this machine's 2 cores.", "",
        "Adapter loads: vLLM's LoRA manager's DEBUG log lines in the engine processes "
        "(`Activating LoRA`: an adapter moved into one of the max_loras slots; `Adding lora`: one "
        "read from disk into the CPU cache), counted during each router's load; vLLM exports no "
        "counter of them.", "",
        "| Router | Requests | Failed | TTFT p50 ms | TTFT p95 ms | Output tok/s | Slot loads per 1,000 "
        "| Disk loads per 1,000 | Slot loads per engine |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for model in MODELS:
        r = doc["routers"][model]
        per = " / ".join(str(v) for v in r["slot_loads_per_engine"]) or "-"
        lines.append(f"| {LABELS[model]} | {r['requests']} | {r['failed']} | {r['ttft_p50_ms']:.0f} | "
                     f"{r['ttft_p95_ms']:.0f} | {r['output_tok_s']:.1f} | {r['slot_loads_per_1k']:.0f} | "
                     f"{r['disk_loads_per_1k']:.0f} | {per} |")
    x = ratios(doc)
    lines += [
        "",
        f"- TTFT p50 adapter-aware / default = {x['ttft_p50']:.2f}x (target <= {TARGET_TTFT_P50}x: "
        f"{verdict(x['ttft_p50'], TARGET_TTFT_P50)})",
        f"- slot loads per 1,000 adapter-aware / default = {x['slot_loads_per_1k']:.2f}x (target <= "
        f"{TARGET_LOADS}x: {verdict(x['slot_loads_per_1k'], TARGET_LOADS)})",
        f"- output tok/s adapter-aware / default = {x['output_tok_s']:.2f}x",
    ]
    decisions = doc.get("decisions") or {}
    if decisions:
        lines.append("- affinity router's decisions: " + ", ".join(
            f"{k} {v}" for k, v in sorted(decisions.items())))
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("TTFT p50 / p95, ms", ("ttft_p50_ms", "ttft_p95_ms")),
               ("adapter slot loads per 1,000 requests", ("slot_loads_per_1k",)),
               ("output tokens/s", ("output_tok_s",)))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (title, names) in zip(axes, metrics, strict=True):
        for j, model in enumerate(MODELS):
            xs = [i + (j - 0.5) * 0.4 for i in range(len(names))]
            ax.bar(xs, [doc["routers"][model][n] for n in names], 0.4, label=LABELS[model])
        ax.set_xticks(range(len(names)), [n.split("_")[1] if n.startswith("ttft") else "" for n in names])
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    p = doc["params"]
    fig.suptitle(f"{p['adapters']} LoRAs, Zipf s {p['zipf_s']}, {p['replicas']} replicas, max_loras "
                 f"{p['max_loras']}, {p['users']} clients (real CPU engines)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---- main -----------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench.lora_routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--replicas", type=int, default=2, help="replicas per model copy")
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--max-cpu-loras", type=int, default=4)
    p.add_argument("--zipf-s", type=float, default=1.1)
    p.add_argument("--seed", type=int, default=41)
    p.add_argument("--users", type=int, default=8, help="closed-loop clients")
    p.add_argument("--duration", type=float, default=75.0, help="seconds of load per router")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-mib", type=int, default=64, help="KV cache per replica (MiB)")
    p.add_argument("--load-factor", type=float, default=None,
                   help="the affinity router's load guard (default: the router's, 1.25)")
    p.add_argument("--results-dir", default=str(ROOT / "results" / "bench"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    run = procs.new_run("lora-routing", "loadtests.bench.lora_routing", ns.config, ns.results_dir, argv)
    workdir = Path(tempfile.mkdtemp(prefix="serve-app-lora-routing-"))
    folders = build_adapters(workdir / "adapters", ns.adapters)
    say(f"built {len(folders)} adapters in {workdir / 'adapters'}")
    logs: dict[str, LoraLog] = {}
    log_configs: dict[str, Path] = {}
    for model in MODELS:
        logs[model] = LoraLog(workdir / f"lora-events-{model}.log")
        log_configs[model] = workdir / f"vllm-logging-{model}.json"
        log_configs[model].write_text(json.dumps(logging_config(logs[model].path), indent=2))
    stack = harness.start_stack(run.config, workdir / "stack", edit=edit_for(ns, folders, log_configs),
                                retries=1, say=say, keys={"bench": (TIER, ["*"])})
    routers: dict[str, dict[str, Any]] = {}
    decisions: dict[str, int] = {}
    try:
        procs.require_loopback(stack.base_url)
        key = stack.keys["bench"]
        urls = affinity.metrics_urls(stack)
        with httpx.Client(timeout=300) as client:
            per_word = affinity.tokens_of(client, stack.root_url, key,
                                          affinity.words(random.Random(0), 400)) / 400
            prompt_words = max(1, int(ns.prompt_tokens / per_word))
            for model in MODELS:  # one request each: the engines have served before the clock runs
                one_request(client, stack.base_url, key, model, "hello", 4)
        for model in MODELS:
            before = affinity.scrape(urls)
            time.sleep(1.0)  # the other copy's engines spin about a second after their last request
            logs[model].mark()
            outcomes, seconds = run_load(stack.base_url, key, model, ns, prompt_words, ns.seed)
            time.sleep(1.0)  # the last log lines reach the file
            events = logs[model].since_mark()
            routers[model] = summarize(outcomes, seconds, events, ns.adapters)
            say(f"{model}: {json.dumps(routers[model])}")
            if model == AWARE:
                decisions = affinity.engine_view(before, affinity.settled(urls, 6.0), model)["decisions"]
                say(f"decisions: {decisions}")
    finally:
        stack.stop(say=say)
    doc = {"command": run.command, "timestamp": run.stamp,
           "params": {**{k: v for k, v in vars(ns).items() if k not in ("results_dir", "config")},
                      "per_word_tokens": per_word},
           "routers": routers, "decisions": decisions,
           "ratios": ratios({"routers": routers}),
           "load_count_source": "vLLM LoRA manager DEBUG log lines (Activating LoRA / Adding lora)"}
    procs.write_results(run.base, doc, markdown(doc))
    png = plot(doc, run.base.with_suffix(".png"))
    say(f"wrote {png}")
    return 1 if any(r["failed"] for r in routers.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
