"""Tenant fairness on a SIMULATED fleet (issue 39): a noisy key beside 8 quiet keys of one tier.

``python -m loadtests.bench.fleet --scenario fairness`` starts one stack from
configs/sim-fleet.yaml with ``sim-llama-8b`` (serve_app/engine/sim: vLLM's scheduler, step times
fitted to aiconfigurator-core's H100 data for Llama-3.1-8B) on ``--replicas`` (4) replicas of
``--max-num-seqs`` (64) engine slots each, the gateway's flow queue on (``flow.enabled``; no ready
requests past the engine's slots, ``flow.ready_per_replica: 0``, so every wait is at the gateway,
where deficit round-robin orders the tenants) and affinity routing off (the prompts share nothing).

The fleet's **capacity** K is the requests it runs at once for the fair tier: the replicas times
the slots a request below the top tier may take (``max_num_seqs - admission.reserved_slots``).
A key's fair share is K / 9. Closed-loop streaming users (``loadgen``: each sends a request,
reads it to its end, sends the next; after a 429/503 it waits ``--backoff`` s):

- **solo**: the 8 quiet keys alone, each with ``--quiet-share`` (1.0) of its fair share in users;
- **2x, 4x** (``--multiples``): the same quiet keys beside one noisy key with the rest of 2K (4K)
  users: at 2x the noisy key sends 10x a quiet key's load (10x its share), at 4x 28x.

All keys are of tier ``--tier`` (standard). ``--premium-users`` (1) closed-loop users of a premium
key run in every phase, apart from the fairness keys, so that "no premium rejection" is a
measurement and not true by construction.

Reported per phase: each quiet key's TTFT p95 (the client's clock, modelled = wall x time scale)
against its solo p95 (target <= 1.5x); Jain's fairness index of the 9 keys' output tokens/s, each
over its max-min fair share (a quiet key's demand is its solo throughput; Jain 1984), once over all
answers (throughput) and once over the answers within the tier's TTFT objective (goodput); the
rejections (429/503) per tier; the gateway's queue wait (Server-Timing ``queue``); the engines' TTFT
histogram; the CPU seconds of the gateway and the rest. The tiers' objectives are given in modelled
time in the config and divided by the time scale for the gateway, whose clock is the wall clock.

EVERY FIGURE HERE IS SIMULATED: the GPUs, their step times and their KV caches are modelled.
The client, the gateway, Ray Serve and the replicas' Python are real and share this machine's
2 cores. Results: ``results/bench/fleet-fairness-<stamp>.{json,md,png}`` (``--results-dir``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtests.bench import procs
from loadtests.bench.affinity import metrics_urls
from loadtests.bench.flow import fair_shares, jain, percentile
from loadtests.bench.loadgen import LoadGen, Sample, Users
from loadtests.bench.procs import say
from loadtests.harness import stack as harness
from loadtests.harness.stack import ROOT
from loadtests.prompts import Prompt

MODEL = "sim-llama-8b"
PREMIUM = "premium"
QUIET_KEYS = 8
CHARS_PER_TOKEN = 4  # the simulated engine's made-up tokenizer (serve_app/engine/sim/tokens.py)
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench.fleet --scenario fairness",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/sim-fleet.yaml")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=64, help="engine slots per replica")
    p.add_argument("--tier", default="standard", help="the tier of the 9 fairness keys")
    p.add_argument("--multiples", default="2,4", help="load levels, in fleet capacities")
    p.add_argument("--quiet-share", type=float, default=1.0,
                   help="each quiet key's users, in fair shares of the fleet's capacity (K / 9)")
    p.add_argument("--premium-users", type=int, default=1, help="a premium key's users in every phase")
    p.add_argument("--prompt-tokens", type=int, default=512, help="median prompt (uniform 0.5x-1.5x)")
    p.add_argument("--max-tokens", type=int, default=128, help="median reply (uniform 0.5x-1.5x)")
    p.add_argument("--prompts", type=int, default=2000, help="distinct prompts in the pool")
    p.add_argument("--time-scale", type=float, default=0.1,
                   help="modelled seconds per wall second (simulated.time_scale)")
    p.add_argument("--duration", type=float, default=120.0, help="wall seconds per phase")
    p.add_argument("--warmup", type=float, default=30.0,
                   help="wall seconds at the start of each phase left out of its figures")
    p.add_argument("--ramp", type=float, default=15.0,
                   help="wall seconds over which the users' first requests are spread")
    p.add_argument("--queue-wait", type=float, default=None,
                   help="the fair tier's max_queue_wait_s, modelled seconds (default: the config's, "
                        "3 TTFT objectives)")
    p.add_argument("--saturation-requests", type=int, default=None,
                   help="the model's admission.saturation_requests (default: the config's)")
    p.add_argument("--backoff", type=float, default=1.0, help="wall seconds a user waits after a 429/503")
    p.add_argument("--load-workers", type=int, default=2, help="load generator processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", default=str(ROOT / "results" / "bench"))
    return p.parse_args(argv)


# ---- the plan of a run (pure) ---------------------------------------------------------------------
def capacity(replicas: int, max_num_seqs: int, reserved_slots: int, top_tier: bool) -> int:
    """Requests of one tier the fleet runs at once: each replica's engine slots, less the top
    tier's reserve for a lower tier (the gateway's flow bound, ``Capacity.lower_slots``)."""
    per = max_num_seqs if top_tier else max(1, max_num_seqs - reserved_slots)
    return replicas * per


def users_for(cap: int, multiple: float, quiet_share: float, quiet_keys: int = QUIET_KEYS) -> tuple[int, int]:
    """(users per quiet key, noisy users) for a load of ``multiple`` x the capacity: each quiet key
    has ``quiet_share`` of a fair share (cap / (quiet_keys + 1)), the noisy key the rest (0 for
    a multiple of 0: the solo phase)."""
    quiet = max(1, round(quiet_share * cap / (quiet_keys + 1)))
    noisy = max(0, round(multiple * cap) - quiet_keys * quiet) if multiple > 0 else 0
    return quiet, noisy


def scaled_tiers(tiers: Mapping[str, Any], time_scale: float) -> dict[str, Any]:
    """The tiers with their objectives (and queue wait bounds) in wall time: the config gives them
    in modelled time, the gateway measures wall time, and modelled = wall x time scale."""
    out: dict[str, Any] = {}
    for name, tier in tiers.items():
        t = json.loads(json.dumps(tier))
        obj = t.get("objectives") or {}
        t["objectives"] = {k: v / time_scale for k, v in obj.items()}
        if t.get("max_queue_wait_s") is not None:
            t["max_queue_wait_s"] = t["max_queue_wait_s"] / time_scale
        out[name] = t
    return out


def make_prompts(seed: int, count: int, prompt_tokens: int, max_tokens: int) -> list[Prompt]:
    """``count`` distinct prompts of about ``prompt_tokens`` (uniform 0.5x-1.5x) of the simulated
    engine's tokens, each with a reply of ``max_tokens`` (uniform 0.5x-1.5x): varied lengths keep the
    closed-loop users from finishing in waves."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        tokens = rng.randint(max(1, prompt_tokens // 2), max(1, prompt_tokens * 3 // 2))
        head = f"request {seed}-{i}: "
        body = " ".join(rng.choice(WORDS) for _ in range(tokens * CHARS_PER_TOKEN // 6 + 1))
        text = (head + body)[: tokens * CHARS_PER_TOKEN]
        out.append(Prompt(text, rng.randint(max(1, max_tokens // 2), max(1, max_tokens * 3 // 2))))
    return out


def in_window(samples: Sequence[Sample], start: float, end: float) -> list[Sample]:
    """The samples whose request started in [start, end) (the phase less its warm-up)."""
    return [s for s in samples if start <= s.start < end]


def key_figures(samples: Sequence[Sample], window_s: float, time_scale: float,
                objective_ms: float) -> dict[str, Any]:
    """One key's figures in modelled time: TTFT p50/p95 (the client's), the gateway's queue wait
    p95, answers and rejections, output tokens/s of all answers and of those within the objective
    (goodput), per modelled second."""
    ok = [s for s in samples if s.status == 200 and s.ttft_ms is not None]
    ttft = [s.ttft_ms * time_scale for s in ok if s.ttft_ms is not None]
    queue = [s.stages["queue"] * time_scale for s in ok if "queue" in s.stages]
    good = [s for s in ok if s.ttft_ms is not None and s.ttft_ms * time_scale <= objective_ms]
    modelled_s = window_s * time_scale
    p50, p95, q95 = percentile(ttft, 0.5), percentile(ttft, 0.95), percentile(queue, 0.95)
    return {
        "requests": len(samples), "ok": len(ok),
        "rejected": sum(s.status in (429, 503) for s in samples),
        "failed": sum(s.status not in (200, 429, 503) for s in samples),
        "ttft_p50_ms": None if p50 is None else round(p50, 1),
        "ttft_p95_ms": None if p95 is None else round(p95, 1),
        "queue_p95_ms": None if q95 is None else round(q95, 1),
        "output_tok_s": round(sum(s.tokens for s in ok) / modelled_s, 1) if modelled_s > 0 else 0.0,
        "goodput_tok_s": round(sum(s.tokens for s in good) / modelled_s, 1) if modelled_s > 0 else 0.0,
    }


def fair_jain(rates: Mapping[str, float], demand: Mapping[str, float]) -> float | None:
    """Jain's index of each key's rate over its max-min fair share of the total (a key whose demand
    is under an equal split gets its demand; keys without a demand split the rest)."""
    shares = fair_shares(rates, demand)
    return jain([rates[k] / shares[k] if shares[k] > 0 else 0.0 for k in rates])


def rejections_by_tier(samples: Sequence[Sample]) -> dict[str, dict[str, Any]]:
    """Per tier: requests, 429s and 503s, and the refusals' messages (up to their first digit)."""
    out: dict[str, dict[str, Any]] = {}
    for tier in sorted({s.tier for s in samples}):
        mine = [s for s in samples if s.tier == tier]
        out[tier] = {"requests": len(mine), "429": sum(s.status == 429 for s in mine),
                     "503": sum(s.status == 503 for s in mine),
                     "reasons": dict(Counter(s.reason or "" for s in mine if s.status in (429, 503)))}
    return out


def verdict(phase: Mapping[str, Any], solo: Mapping[str, Any], max_ratio: float = 1.5,
            min_jain: float = 0.9) -> dict[str, Any]:
    """A loaded phase against the targets: every quiet key's TTFT p95 within ``max_ratio`` of its
    solo p95, Jain (throughput and goodput) at least ``min_jain``, no premium rejection."""
    ratios = {}
    for k, fig in phase["keys"].items():
        base = solo["keys"].get(k, {}).get("ttft_p95_ms")
        if k.startswith("quiet") and base and fig.get("ttft_p95_ms") is not None:
            ratios[k] = round(fig["ttft_p95_ms"] / base, 2)
    worst = max(ratios.values()) if ratios else None
    quiet_rejected = sum(f.get("rejected", 0) for k, f in phase["keys"].items() if k.startswith("quiet"))
    premium = phase["rejections"].get(PREMIUM, {})
    premium_rejected = premium.get("429", 0) + premium.get("503", 0)
    jt, jg = phase.get("jain_throughput"), phase.get("jain_goodput")
    return {
        "quiet_p95_vs_solo": ratios, "worst_quiet_p95_vs_solo": worst,
        "quiet_rejected": quiet_rejected,
        "quiet_ok": (worst is not None and worst <= max_ratio and len(ratios) == QUIET_KEYS
                     and not quiet_rejected),
        "jain_throughput_ok": jt is not None and jt >= min_jain,
        "jain_goodput_ok": jg is not None and jg >= min_jain,
        "premium_rejected": premium_rejected, "premium_ok": premium_rejected == 0,
    }


# ---- the run --------------------------------------------------------------------------------------
def edit_for(ns: argparse.Namespace) -> Any:
    def edit(args: dict[str, Any]) -> None:
        base = next(m for m in args["models"] if m["id"] == MODEL)
        m = json.loads(json.dumps(base))
        m["simulated"] = {**m["simulated"], "time_scale": ns.time_scale}
        m["engine"] = {**m["engine"], "max_num_seqs": ns.max_num_seqs}
        m["deployment"] = {**m.get("deployment", {}), "num_replicas": ns.replicas}
        m["routing"] = {"affinity": "off"}
        m["flow"] = {"enabled": True, "ready_per_replica": 0}
        if ns.saturation_requests is not None:
            m["admission"] = {**m.get("admission", {}), "saturation_requests": ns.saturation_requests}
        args["models"] = [m]
        args["routes"] = []
        if ns.queue_wait is not None:
            args["tiers"][ns.tier] = {**args["tiers"][ns.tier], "max_queue_wait_s": ns.queue_wait}
        args["tiers"] = scaled_tiers(args["tiers"], ns.time_scale)
    return edit


def phase(gen: LoadGen, stack: harness.Stack, urls: list[str], ns: argparse.Namespace, name: str,
          groups: list[Users], prompts: list[Prompt], objectives: Mapping[str, float],
          seed: int) -> dict[str, Any]:
    from loadtests.bench.fleet import cpu_by_kind, quantile, ttft_buckets

    say(f"{name}: " + ", ".join(f"{g.key} x{g.count}" for g in groups))
    hist0, cpu0, t0 = ttft_buckets(urls, MODEL), cpu_by_kind(stack), time.monotonic()
    samples = gen.run(stack.base_url, MODEL, groups, ns.duration, prompts, 10 ** 6, ns.backoff, seed,
                      ns.ramp)
    took, cpu1 = time.monotonic() - t0, cpu_by_kind(stack)
    hist = ttft_buckets(urls, MODEL)
    window_s = ns.duration - ns.warmup
    counted = in_window(samples, t0 + ns.warmup, t0 + ns.duration)
    keys = {g.key: key_figures([s for s in counted if s.key == g.key], window_s, ns.time_scale,
                               objectives[g.tier]) for g in groups}
    cpu = {k: round(cpu1[k] - cpu0[k], 1) for k in cpu1}
    out = {
        "name": name, "users": {g.key: g.count for g in groups}, "seconds": round(took, 1),
        "window_s": window_s, "keys": keys, "rejections": rejections_by_tier(samples),
        "requests": len(samples),
        "output_tok_s": round(sum(k["output_tok_s"] for k in keys.values()), 1),
        "engine_ttft_p50_ms": round(quantile(hist0, hist, 0.5) * 1000.0, 1),
        "engine_ttft_p95_ms": round(quantile(hist0, hist, 0.95) * 1000.0, 1),
        "gateway_cpu_s": cpu["gateway"], "cpu_s": cpu,
        "gateway_cores": round(cpu["gateway"] / max(1e-9, took), 2),
        "cpu_cores": round(sum(cpu.values()) / max(1e-9, took), 2),
    }
    return out


def with_jain(p: dict[str, Any], solo: Mapping[str, Any] | None) -> dict[str, Any]:
    """Jain's indices of the fairness keys (the premium key is not one), a quiet key's demand being
    its solo throughput (goodput for the goodput index)."""
    if solo is None:
        return p
    fair = [k for k in p["keys"] if k != PREMIUM]
    for field, out in (("output_tok_s", "jain_throughput"), ("goodput_tok_s", "jain_goodput")):
        rates = {k: p["keys"][k][field] for k in fair}
        demand = {k: solo["keys"][k][field] for k in fair if k in solo["keys"]}
        j = fair_jain(rates, demand)
        p[out] = None if j is None else round(j, 3)
    p["raw_jain_throughput"] = (None if (r := jain([p["keys"][k]["output_tok_s"] for k in fair])) is None
                                else round(r, 3))
    return p


def markdown(doc: dict[str, Any]) -> str:
    p, ts = doc["params"], doc["params"]["time_scale"]
    solo = doc["phases"][0]
    lines = [
        "**SIMULATED figures** (serve_app/engine/sim, profile h100-llama3.1-8b fitted to "
        "aiconfigurator-core; no GPU): the GPUs, their step times and KV caches are modelled; the "
        "client, gateway, Ray Serve and replicas are real processes on 2 shared CPU cores.", "",
        f"Command: `{doc['command']}`", "",
        f"Fairness: {p['replicas']} simulated H100 replicas of Llama-3.1-8B, max_num_seqs "
        f"{p['max_num_seqs']}, the gateway's flow queue on (no ready requests), affinity off; "
        f"capacity K = {doc['capacity']} requests of tier {p['tier']} at once (a key's fair share "
        f"K/9 = {doc['capacity'] / 9:.1f}); closed-loop streaming users, prompts of ~{p['prompt_tokens']} "
        f"tokens and replies of ~{p['max_tokens']} (each uniform 0.5x-1.5x); time scale {ts} "
        f"(modelled = wall x {ts}; every time below is modelled); {p['duration']:g} s wall per phase, "
        f"the first {p['warmup']:g} s left out; {p['premium_users']} premium user(s) beside, in every phase. "
        f"Tier {p['tier']}: TTFT objective {doc['objectives_modelled_ms'][p['tier']]:g} ms, queue wait bound "
        f"{doc['settings']['queue_wait_modelled_s']:g} s, shed at {doc['settings']['shed_at']:g} of "
        f"saturation_requests {doc['settings']['saturation_requests']} (requests held, waiting included).",
        "",
        "| Phase | Users (quiet each / noisy / premium) | Quiet TTFT p95 ms: the key worst off (its solo) | worst / solo "
        "(≤ 1.5) | Quiet queue p95 ms | Noisy TTFT p95 ms | Jain throughput / goodput (≥ 0.9) | raw Jain "
        "| Output tok/s (modelled) | Rejected: tier / premium | Engine TTFT p50 / p95 ms | Gateway CPU "
        "s (cores) | Run s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for ph in doc["phases"]:
        users = ph["users"]
        quiet = {k: v for k, v in ph["keys"].items() if k.startswith("quiet")}
        v = ph.get("verdict") or {}
        by_ratio = v.get("quiet_p95_vs_solo") or {}
        worst_key = (max(by_ratio, key=lambda k: by_ratio[k]) if by_ratio
                     else max(quiet, key=lambda k: quiet[k]["ttft_p95_ms"] or 0.0) if quiet else None)
        worst = (f"{quiet[worst_key]['ttft_p95_ms']:.0f} ({solo['keys'][worst_key]['ttft_p95_ms']:.0f})"
                 if worst_key else "-")
        qq = max((f["queue_p95_ms"] or 0.0) for f in quiet.values()) if quiet else 0.0
        noisy = ph["keys"].get("noisy", {})
        rej = ph["rejections"]
        tier_rej = rej.get(p["tier"], {})
        prem_rej = rej.get(PREMIUM, {})
        lines.append(
            f"| {ph['name']} | {users.get('quiet-0', 0)} / {users.get('noisy', 0)} / {users.get(PREMIUM, 0)} "
            f"| {worst} | {_f(v.get('worst_quiet_p95_vs_solo'), '{:.2f}')} | {qq:.0f} "
            f"| {_f(noisy.get('ttft_p95_ms'), '{:.0f}')} "
            f"| {_f(ph.get('jain_throughput'), '{:.3f}')} / {_f(ph.get('jain_goodput'), '{:.3f}')} "
            f"| {_f(ph.get('raw_jain_throughput'), '{:.3f}')} | {ph['output_tok_s']:.0f} "
            f"| {tier_rej.get('429', 0) + tier_rej.get('503', 0)} of {tier_rej.get('requests', 0)} / "
            f"{prem_rej.get('429', 0) + prem_rej.get('503', 0)} of {prem_rej.get('requests', 0)} "
            f"| {ph['engine_ttft_p50_ms']:.0f} / {ph['engine_ttft_p95_ms']:.0f} "
            f"| {ph['gateway_cpu_s']:.1f} ({ph['gateway_cores']:.2f}) | {ph['seconds']:.0f} |")
    lines += ["", "Each quiet key's TTFT p95 (modelled ms), solo and beside the noisy key:", "",
              "| Key | " + " | ".join(ph["name"] for ph in doc["phases"]) + " |",
              "| --- |" + " ---: |" * len(doc["phases"])]
    for k in sorted(solo["keys"]):
        if not k.startswith("quiet"):
            continue
        cells = []
        for ph in doc["phases"]:
            f = ph["keys"].get(k, {})
            ratio = (ph.get("verdict") or {}).get("quiet_p95_vs_solo", {}).get(k)
            cells.append(f"{_f(f.get('ttft_p95_ms'), '{:.0f}')}" + (f" ({ratio:.2f}x)" if ratio else ""))
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += ["", "Verdicts (targets: every quiet key's p95 ≤ 1.5x solo, Jain ≥ 0.9, no premium rejection):", ""]
    for ph in doc["phases"][1:]:
        v = ph["verdict"]
        lines.append(f"- {ph['name']}: quiet p95 {'MET' if v['quiet_ok'] else 'MISSED'} (worst "
                     f"{_f(v['worst_quiet_p95_vs_solo'], '{:.2f}')}x, {v['quiet_rejected']} quiet "
                     "requests refused); Jain throughput "
                     f"{'MET' if v['jain_throughput_ok'] else 'MISSED'}, goodput "
                     f"{'MET' if v['jain_goodput_ok'] else 'MISSED'}; premium rejections "
                     f"{v['premium_rejected']} ({'MET' if v['premium_ok'] else 'MISSED'})")
    lines += ["", "Refusals by tier and message:", ""]
    for ph in doc["phases"]:
        for tier, r in ph["rejections"].items():
            if r["reasons"]:
                lines.append(f"- {ph['name']}, {tier}: " + "; ".join(f"{n} x {m!r}" for m, n in r["reasons"].items()))
    lines += ["", "CPU seconds by process kind per phase: " + "; ".join(
        f"{ph['name']}: " + ", ".join(f"{k} {v:.1f}" for k, v in ph["cpu_s"].items()) for ph in doc["phases"])]
    return "\n".join(lines) + "\n"


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def plot(doc: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = doc["phases"]
    quiet = sorted(k for k in phases[0]["keys"] if k.startswith("quiet"))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / len(phases)
    for j, ph in enumerate(phases):
        xs = [i + (j - (len(phases) - 1) / 2) * width for i in range(len(quiet))]
        ax1.bar(xs, [ph["keys"].get(k, {}).get("ttft_p95_ms") or 0.0 for k in quiet], width, label=ph["name"])
    solo = [phases[0]["keys"][k]["ttft_p95_ms"] or 0.0 for k in quiet]
    ax1.scatter(range(len(quiet)), [1.5 * s for s in solo], marker="_", s=300, color="red",
                label="1.5x solo (target)", zorder=3)
    ax1.set_xticks(range(len(quiet)), quiet, fontsize=8)
    ax1.set_ylabel("TTFT p95, modelled ms")
    ax1.set_title("each quiet key's TTFT p95", fontsize=10)
    ax1.legend(fontsize=8)
    ax1.grid(axis="y", alpha=0.3)
    loaded = phases[1:]
    xs = list(range(len(loaded)))
    ax2.bar([x - 0.2 for x in xs], [ph.get("jain_throughput") or 0.0 for ph in loaded], 0.4, label="throughput")
    ax2.bar([x + 0.2 for x in xs], [ph.get("jain_goodput") or 0.0 for ph in loaded], 0.4, label="goodput")
    ax2.axhline(0.9, color="red", lw=1, label="0.9 (target)")
    ax2.set_xticks(xs, [ph["name"] for ph in loaded])
    ax2.set_ylim(0, 1.05)
    ax2.set_title("Jain (max-min fair share)", fontsize=10)
    ax2.legend(fontsize=8)
    p = doc["params"]
    fig.suptitle(f"SIMULATED: {p['replicas']} H100 replicas of Llama-3.1-8B, a noisy key beside 8 quiet "
                 f"keys (tier {p['tier']}), closed loop at K = {doc['capacity']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    run = procs.new_run("fleet-fairness", "loadtests.bench.fleet", ns.config, ns.results_dir,
                        ["--scenario", "fairness", *(argv if argv is not None else sys.argv[1:])])
    app = harness.read_config(run.config)
    model = next(m for m in app.models if m.id == MODEL)
    tier = app.tiers[ns.tier]
    cap = capacity(ns.replicas, ns.max_num_seqs, model.admission.reserved_slots,
                   tier.priority == app.top_priority)
    objectives = {name: t.objectives.ttft_p95_ms for name, t in app.tiers.items()}  # modelled ms
    multiples = [float(x) for x in ns.multiples.split(",") if x.strip()]
    keys = {f"quiet-{i}": (ns.tier, ["*"]) for i in range(QUIET_KEYS)} | {"noisy": (ns.tier, ["*"])}
    keys[PREMIUM] = (PREMIUM, ["*"])
    prompts = make_prompts(ns.seed, ns.prompts, ns.prompt_tokens, ns.max_tokens)
    workdir = Path(tempfile.mkdtemp(prefix="serve-app-fleet-fair-"))
    stack = harness.start_stack(run.config, workdir, edit=edit_for(ns), retries=1, say=say, keys=keys)
    phases: list[dict[str, Any]] = []
    try:
        procs.require_loopback(stack.base_url)
        urls = metrics_urls(stack)
        with LoadGen(ns.load_workers) as gen:
            for i, multiple in enumerate([0.0, *multiples]):
                quiet, noisy = users_for(cap, multiple, ns.quiet_share)
                groups = [Users(f"quiet-{q}", stack.keys[f"quiet-{q}"], ns.tier, quiet) for q in range(QUIET_KEYS)]
                if noisy:
                    groups.append(Users("noisy", stack.keys["noisy"], ns.tier, noisy))
                if ns.premium_users:
                    groups.append(Users(PREMIUM, stack.keys[PREMIUM], PREMIUM, ns.premium_users))
                name = "solo" if multiple == 0 else f"{multiple:g}x"
                got = with_jain(phase(gen, stack, urls, ns, name, groups, prompts, objectives,
                                      ns.seed * 100 + i), phases[0] if phases else None)
                if phases:
                    got["verdict"] = verdict(got, phases[0])
                phases.append(got)
                say(f"{name}: {json.dumps({k: v for k, v in got.items() if k != 'keys'})}")
    finally:
        stack.stop(say=say)
    settings = {"queue_wait_modelled_s": ns.queue_wait if ns.queue_wait is not None else tier.queue_wait_s,
                "saturation_requests": ns.saturation_requests or model.admission.saturation_requests,
                "shed_at": tier.shed_at, "reserved_slots": model.admission.reserved_slots}
    doc = {"command": run.command, "timestamp": run.stamp, "simulated": True, "scenario": "fairness",
           "capacity": cap, "objectives_modelled_ms": objectives, "settings": settings,
           "params": {k: v for k, v in vars(ns).items() if k not in ("results_dir", "config")},
           "phases": phases}
    procs.write_results(run.base, doc, markdown(doc))
    say(f"wrote {plot(doc, run.base.with_suffix('.png'))}")
    return 0 if all(math.isfinite(ph["output_tok_s"]) for ph in phases) else 1
