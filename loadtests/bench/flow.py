"""The gateway's flow queue on and off, under the same load (issue 23).

``python -m loadtests.bench.flow`` starts ``configs/local.yaml`` twice through the harness
(``loadtests.harness.stack.start_stack``): first with tiny-chat's queue off (``flow.enabled:
false``, today's admission), then on; nothing else differs. One key per role is made with the
public ``serve-app keys create``, by default with its per-key RPM, TPM and concurrency limits
lifted (``--key-limits lifted``): otherwise local.yaml's batch key (300 RPM) and standard key
(600 RPM) answer 429 long before the engine is loaded, and the queue is never reached. Closed-loop
users (each sends one streaming chat request, reads it to the end, and sends the next; after a
429/503 it waits ``--backoff`` s) drive it from ``--load-workers`` processes
(``loadtests.bench.loadgen``), prompts from ``loadtests/data``, ``max_tokens`` capped at
``--max-tokens``:

(a) **Tiers under overload.** A mix of premium and batch users (``--premium-share`` of them
    premium). With the queue off, the users step up (``--search-users``, ``--search-duration`` s
    each) until premium's TTFT p95 first misses its objective: that is the base load L (or give
    ``--base-users``). Then, in both modes, ``--duration`` s at 2L and at 4L: premium's and batch's
    TTFT p95, rejections (429/503) and output tokens/s.
(b) **Fairness.** Two keys of one tier (``--fair-tier``): a quiet one at concurrency ``--quiet``
    (2) alone (its solo baseline), then with a noisy one at ``--noisy`` (32). The quiet key's TTFT
    p95 against its solo baseline (by the client's clock and by the front door's), and Jain's
    index of the two keys' goodput (output tokens/s of answers within the tier's TTFT objective),
    each normalised by its max-min fair share (Jain 1984): the quiet key's share is the smaller of
    its solo goodput and half the total, the noisy key's is the rest. 1.0 is a fair split, 0.5 one
    key with everything.
(c) **Throughput.** Total output tokens/s of (a), queue on over queue off.

``--aa`` runs the same with the queue off in both modes: its on/off ratios are the method's own
noise on this machine, the yardstick for (c).

``--repeats`` (4) runs both modes that many times, the order alternating (off, on; on, off; ...);
every figure in the report is the median of the repeats (the on/off ratio: the median of each
repeat's own ratio), and each repeat's ratios are listed, with the median of the repeats where the
queue ran first and of those where it ran second. The order may matter on this machine: in
docs/perf/flow-20261205-134206 on/off was 1.07 (2x) and 1.01 (4x) in the repeat where the queue ran
first and 0.88 and 0.85 where it ran second (in flow-20261205-132141 the order showed no such
pattern), so an even count, each mode first as often, is the default.

TTFT is the client's own (from sending the request to the first content token); the machine is a
shared 2-core one where this client, the gateway and the engine compete for the cores, so compare
the two modes of one run, not absolute figures across runs. Results: ``results/bench/flow-<stamp>``
``.json``, ``.md`` and ``.png`` (``--results-dir``); ``--render <json>`` writes an earlier run's
``.md`` and ``.png`` again. Traffic goes to 127.0.0.1 only; each stack is stopped at the end, also
on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtests.bench import procs
from loadtests.bench.loadgen import LoadGen, Sample, Users
from loadtests.bench.procs import require_loopback, say
from loadtests.harness import stack as harness
from loadtests.harness.stack import ROOT
from loadtests.prompts import Prompt, load_prompts
from loadtests.sla import Objective, read_objectives

MODEL = "tiny-chat"
MODES = ("off", "on")
MULTIPLES = (2, 4)


# ---- numbers -----------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def jain(xs: Sequence[float]) -> float | None:
    """Jain's fairness index: (sum x)^2 / (n sum x^2); 1.0 when all are equal, 1/n when one has all."""
    if not xs or not any(xs):
        return None
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def fair_shares(goodput: Mapping[str, float], demand: Mapping[str, float]) -> dict[str, float]:
    """Max-min fair shares of the total goodput: a key whose demand (its goodput alone) is under an
    equal split gets its demand, and the others split the rest equally."""
    left = sum(goodput.values())
    keys = sorted(goodput, key=lambda k: demand.get(k, math.inf))
    shares: dict[str, float] = {}
    for i, k in enumerate(keys):
        share = min(demand.get(k, math.inf), left / (len(keys) - i))
        shares[k] = share
        left -= share
    return shares


def fair_jain(goodput: Mapping[str, float], demand: Mapping[str, float]) -> float | None:
    """Jain's index of each key's goodput over its max-min fair share."""
    shares = fair_shares(goodput, demand)
    return jain([goodput[k] / shares[k] if shares[k] > 0 else 0.0 for k in goodput])


def median_tree(trees: Sequence[Any]) -> Any:
    """The repeats' results merged: each number the median of the repeats that have it (ints stay
    ints), each mapping merged key by key, anything else the first repeat's."""
    present = [t for t in trees if t is not None]
    if not present:
        return None
    if all(isinstance(t, Mapping) for t in present):
        keys = list(dict.fromkeys(k for t in present for k in t))
        return {k: median_tree([t.get(k) for t in present]) for k in keys}
    if all(isinstance(t, int | float) and not isinstance(t, bool) for t in present):
        mid = statistics.median(present)
        return round(mid) if all(isinstance(t, int) for t in present) else mid
    return present[0]


def ratios(runs: Sequence[Mapping[str, Any]], level_key: str) -> list[float]:
    """Each repeat's own output tokens/s with the queue on over off, at one load level."""
    out = []
    for r in runs:
        off = r["modes"].get("off", {}).get("levels", {}).get(level_key, {}).get("total_output_tok_s")
        on = r["modes"].get("on", {}).get("levels", {}).get(level_key, {}).get("total_output_tok_s")
        if on is not None and off:
            out.append(on / off)
    return out


def tail_stages(samples: Sequence[Sample], q: float = 0.95) -> dict[str, float]:
    """Median of each stage over the answers at or above the ``q`` TTFT quantile (the tail that
    makes the p95), with ``client_head`` (the client's time to the head) and ``beyond_total``
    (that minus the gateway's ``total``: time before the front door stamped the request and
    after the head left)."""
    ok = sorted((s for s in samples if s.ttft_ms is not None and s.stages), key=lambda s: s.ttft_ms or 0.0)
    if not ok:
        return {}
    tail = ok[min(len(ok) - 1, int(q * len(ok))):]
    names = sorted({k for s in tail for k in s.stages})
    out = {k: round(statistics.median(s.stages.get(k, 0.0) for s in tail), 1) for k in names}
    heads = [s.head_ms for s in tail if s.head_ms is not None]
    if heads:
        out["client_head"] = round(statistics.median(heads), 1)
        out["beyond_total"] = round(statistics.median(
            (s.head_ms or 0.0) - s.stages.get("total", 0.0) for s in tail if s.head_ms is not None), 1)
    return out


def summarise(samples: Sequence[Sample], objective_ms: Mapping[str, float],
              group: str = "tier") -> dict[str, dict[str, Any]]:
    """Per tier (or key): requests, answers, rejections, TTFT p50/p95, output and goodput tokens/s
    (over the span from the first start to the last end of the whole set)."""
    if not samples:
        return {}
    span = max(s.end for s in samples) - min(s.start for s in samples)
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({getattr(s, group) for s in samples}):
        mine = [s for s in samples if getattr(s, group) == name]
        ok = [s for s in mine if s.status == 200 and s.ttft_ms is not None]
        ttft = [s.ttft_ms for s in ok if s.ttft_ms is not None]
        obj = objective_ms[mine[0].tier]
        good = [s for s in ok if s.ttft_ms is not None and s.ttft_ms <= obj]
        p50, p95 = percentile(ttft, 0.5), percentile(ttft, 0.95)
        # The SLA's own clock (issue 22): from the front door's stamp to the head, which a stream
        # sends with its first token; the client's TTFT adds its own and the network's time.
        door = percentile([s.stages["total"] for s in ok if "total" in s.stages], 0.95)
        out[name] = {
            "tier": mine[0].tier,
            "requests": len(mine),
            "ok": len(ok),
            "rejected": sum(s.status in (429, 503) for s in mine),
            "rejected_503": sum(s.status == 503 for s in mine),
            "refusals": dict(Counter(s.reason or "" for s in mine if s.status in (429, 503))),
            "failed": sum(s.status not in (200, 429, 503) for s in mine),
            "ttft_p50_ms": None if p50 is None else round(p50, 1),
            "ttft_p95_ms": None if p95 is None else round(p95, 1),
            "front_door_ttft_p95_ms": None if door is None else round(door, 1),
            "objective_ms": obj,
            "output_tok_s": round(sum(s.tokens for s in ok) / span, 1) if span > 0 else 0.0,
            "goodput_tok_s": round(sum(s.tokens for s in good) / span, 1) if span > 0 else 0.0,
        }
    return out


def total_tok_s(samples: Sequence[Sample]) -> float:
    if not samples:
        return 0.0
    span = max(s.end for s in samples) - min(s.start for s in samples)
    return round(sum(s.tokens for s in samples if s.status == 200) / span, 1) if span > 0 else 0.0


# What --key-limits lifted sets on each bench key (``serve-app keys create`` overrides): the load is
# meant to reach the engine and its queue, not to stop at one key's rate limits.
LIFTED = {"rpm": 1_000_000, "tpm": 1_000_000_000, "max-concurrent": 4096}


def make_key(keys_file: Path, key_id: str, tier: str, limits: str) -> str:
    """A key made with the public ``serve-app keys create``; with ``limits`` "lifted" its per-key
    RPM, TPM and concurrency are overridden (``LIFTED``), with "tier" it keeps its tier's."""
    argv = [*harness.CLI, "keys", "create", "--keys-file", str(keys_file), "--id", key_id,
            "--tier", tier, "--models", "*"]
    if limits == "lifted":
        for name, value in LIFTED.items():
            argv += [f"--{name}", str(value)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise SystemExit(f"serve-app keys create --id {key_id} failed: {done.stderr[-500:]}")
    return lines[-1].strip()


def mix(users: int, share: float, keys: Mapping[str, str]) -> list[Users]:
    """``users`` split into premium (``share``, at least one) and batch users."""
    premium = max(1, round(users * share))
    return [Users("premium", keys["premium"], "premium", premium),
            Users("batch", keys["batch"], "batch", max(0, users - premium))]


# ---- one mode ----------------------------------------------------------------------------------
def flow_edit(on: bool) -> Any:
    """The config edit of a mode: tiny-chat's flow queue on or off (nothing else changes)."""
    def edit(args: dict[str, Any]) -> None:
        for m in args["models"]:
            if m["id"] == MODEL:
                m["flow"] = {**(m.get("flow") or {}), "enabled": on}
    return edit


def level(samples: list[Sample], objective_ms: Mapping[str, float], users: int) -> dict[str, Any]:
    return {"users": users, "tiers": summarise(samples, objective_ms),
            "total_output_tok_s": total_tok_s(samples),
            "premium_tail_stages_ms": tail_stages([s for s in samples if s.tier == "premium"])}


def search_base(gen: LoadGen, base_url: str, keys: Mapping[str, str], ns: argparse.Namespace,
                prompts: Sequence[Prompt], objective_ms: Mapping[str, float]) -> tuple[int, list[dict[str, Any]]]:
    """The first users level whose premium TTFT p95 misses its objective (queue off)."""
    steps = []
    for users in ns.search_users:
        samples = gen.run(base_url, MODEL, mix(users, ns.premium_share, keys), ns.search_duration,
                          prompts, ns.max_tokens, ns.backoff, seed=users)
        lv = level(samples, objective_ms, users)
        steps.append(lv)
        p95 = lv["tiers"].get("premium", {}).get("ttft_p95_ms")
        say(f"search: {users} users -> premium TTFT p95 {p95} ms (objective {objective_ms['premium']:g})")
        if p95 is None or p95 > objective_ms["premium"]:
            return users, steps
    return ns.search_users[-1], steps


def run_mode(gen: LoadGen, mode: str, ns: argparse.Namespace, config: Path, workdir: Path, prompts: list[Prompt],
             objective_ms: Mapping[str, float], base_users: int | None) -> dict[str, Any]:
    """One stack with the queue ``mode`` (off/on): the search (off, unless given), 2L and 4L, and
    the fairness pair."""
    key_ids = {"premium": "premium", "batch": "batch", "noisy": ns.fair_tier, "quiet": ns.fair_tier}
    (workdir / mode).mkdir(parents=True, exist_ok=True)
    # The stack's keys file (start_stack's workdir/keys.yaml), made before it starts.
    keys = {kid: make_key(workdir / mode / "keys.yaml", kid, tier, ns.key_limits)
            for kid, tier in key_ids.items()}
    stack = harness.start_stack(config, workdir / mode, edit=flow_edit(mode == "on" and not ns.aa),
                                retries=1, say=say)
    out: dict[str, Any] = {"mode": mode}
    try:
        require_loopback(stack.base_url)
        gen.run(stack.base_url, MODEL, mix(4, 0.5, keys), ns.warmup, prompts, ns.max_tokens,
                ns.backoff)  # engines warm, series made
        if base_users is None:
            base_users, out["search"] = search_base(gen, stack.base_url, keys, ns, prompts, objective_ms)
        out["base_users"] = base_users
        out["levels"] = {}
        for m in MULTIPLES:
            users = m * base_users
            say(f"[{mode}] {m}x: {users} users for {ns.duration:g} s")
            samples = gen.run(stack.base_url, MODEL, mix(users, ns.premium_share, keys),
                              ns.duration, prompts, ns.max_tokens, ns.backoff, seed=m)
            out["levels"][str(m)] = level(samples, objective_ms, users)
            say(f"[{mode}] {m}x: {out['levels'][str(m)]}")
        quiet = Users("quiet", keys["quiet"], ns.fair_tier, ns.quiet)
        noisy = Users("noisy", keys["noisy"], ns.fair_tier, ns.noisy)
        say(f"[{mode}] fairness: quiet key alone at concurrency {ns.quiet}")
        solo = gen.run(stack.base_url, MODEL, [quiet], ns.duration, prompts, ns.max_tokens,
                       ns.backoff, seed=1)
        say(f"[{mode}] fairness: quiet ({ns.quiet}) beside noisy ({ns.noisy})")
        both = gen.run(stack.base_url, MODEL, [quiet, noisy], ns.duration, prompts,
                       ns.max_tokens, ns.backoff, seed=2)
        out["fairness"] = fairness(solo, both, objective_ms)
        say(f"[{mode}] fairness: {out['fairness']}")
    finally:
        stack.stop(say=say)
    return out


def quiet_vs_solo(alone: Mapping[str, Any], keys: Mapping[str, Any], field: str) -> float | None:
    """The quiet key's TTFT p95 beside the noisy key over its solo p95, by one clock: the client's
    (``ttft_p95_ms``: to the first event with content text) or the front door's
    (``front_door_ttft_p95_ms``, the SLA's clock: to the head, sent with the first output). Solo,
    the two p95s differ by about one ``stream_interval_ms`` (50 ms, most of the client's p95): a
    first output without text leaves the client waiting for the next paced event."""
    solo_p95 = alone.get(field)
    quiet_p95 = keys.get("quiet", {}).get(field)
    return round(quiet_p95 / solo_p95, 2) if quiet_p95 and solo_p95 else None


def fairness(solo: list[Sample], both: list[Sample], objective_ms: Mapping[str, float]) -> dict[str, Any]:
    alone = summarise(solo, objective_ms, group="key").get("quiet", {})
    keys = summarise(both, objective_ms, group="key")
    goodput = {k: v["goodput_tok_s"] for k, v in keys.items()}
    demand = {"quiet": alone.get("goodput_tok_s", 0.0)}
    return {
        "solo": alone, "keys": keys,
        "quiet_ttft_vs_solo": quiet_vs_solo(alone, keys, "ttft_p95_ms"),
        "quiet_door_ttft_vs_solo": quiet_vs_solo(alone, keys, "front_door_ttft_p95_ms"),
        "jain_fair_share": (None if (j := fair_jain(goodput, demand)) is None else round(j, 3)),
        "jain_raw": (None if (r := jain(list(goodput.values()))) is None else round(r, 3)),
    }


# ---- the report --------------------------------------------------------------------------------
def _v(x: Any, fmt: str = "{:,.0f}") -> str:
    return "–" if x is None else fmt.format(x)


def markdown(doc: Mapping[str, Any]) -> str:
    modes = doc["modes"]
    obj = doc["objectives_ms"]
    lines = [f"# Gateway flow queue: on vs off ({doc['timestamp']})", "",
             f"`{doc['command']}` on `{doc['config']}`; base load L = {doc['base_users']} users "
             f"({doc['premium_share']:.0%} premium, the rest batch), max_tokens ≤ {doc['max_tokens']}, "
             f"{doc['duration_s']:g} s per level; the bench keys' own limits: "
             f"{doc.get('key_limits', 'tier')} (lifted: RPM, TPM and concurrency overridden, so the "
             "load reaches the engine; tier: the tiers' key_limits apply, and 429s count as "
             f"rejections). Users spread over {doc.get('load_workers', 1)} load-generator "
             "process(es). Shared 2-core machine (other sessions' work ran beside it): compare on "
             "and off within this run, not across runs. "
             f"Every figure is the median of {doc.get('repeats', 1)} repeat(s) of both modes, the "
             "order alternating.", *(["", "**A/A run (`--aa`): the queue is off in both modes; "
                                      "\"on\" is a second \"off\", and on/off is this method's "
                                      "noise.**"] if doc.get("aa") else []), "",
             "## (a) Tiers at 2x and 4x the load where premium first misses its objective", "",
             "| load | queue | premium TTFT p95 (obj {p}): client / front door | premium rejected "
             "| batch TTFT p95 (obj {b}): client / front door | batch rejected | output tok/s |".format(
                 p=_v(obj["premium"]), b=_v(obj["batch"])),
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for m in MULTIPLES:
        for mode in MODES:
            lv = modes.get(mode, {}).get("levels", {}).get(str(m))
            if lv is None:
                continue
            p, b = lv["tiers"].get("premium", {}), lv["tiers"].get("batch", {})
            lines.append(f"| {m}x ({lv['users']} users) | {mode} | {_v(p.get('ttft_p95_ms'))} / "
                         f"{_v(p.get('front_door_ttft_p95_ms'))} ms "
                         f"| {p.get('rejected', 0)} of {p.get('requests', 0)} | {_v(b.get('ttft_p95_ms'))} / "
                         f"{_v(b.get('front_door_ttft_p95_ms'))} ms "
                         f"| {b.get('rejected', 0)} of {b.get('requests', 0)} | {_v(lv['total_output_tok_s'])} |")
    tails = [(m, mode, modes[mode]["levels"][str(m)].get("premium_tail_stages_ms"))
             for m in MULTIPLES for mode in MODES
             if str(m) in modes.get(mode, {}).get("levels", {})]
    if any(t for _, _, t in tails):
        lines += ["", "Where premium's slowest 5 % waited (medians, ms; the gateway's Server-Timing "
                  "stages at the head, `client_head` the client's own time to the head, "
                  "`beyond_total` that minus the gateway's `total`):", ""]
        for m, mode, t in tails:
            if t:
                lines.append(f"- {m}x {mode}: " + ", ".join(f"{k} {v:,.0f}" for k, v in t.items()))
    refusals = [(m, mode, tier, r) for m in MULTIPLES for mode in MODES for tier in ("premium", "batch")
                for r in [modes.get(mode, {}).get("levels", {}).get(str(m), {}).get("tiers", {})
                          .get(tier, {}).get("refusals")] if r]
    if refusals:
        lines += ["", "Why requests were refused (the error message up to its first number):", ""]
        for m, mode, tier, r in refusals:
            lines.append(f"- {m}x {mode}, {tier}: " + "; ".join(f"{n} x \"{why}\"" for why, n in r.items()))
    search = modes.get("off", {}).get("search")
    if search:
        lines += ["", "Search (queue off): " + ", ".join(
            f"{s['users']} users → premium p95 {_v(s['tiers'].get('premium', {}).get('ttft_p95_ms'))} ms"
            for s in search)]
    lines += ["", f"## (b) Fairness: a noisy key (concurrency {doc['noisy']}) and a quiet key "
              f"({doc['quiet']}), tier {doc['fair_tier']}", "",
              "| queue | quiet TTFT p95 solo | quiet TTFT p95 beside noisy | ratio (≤ 2) | the same "
              "at the front door: solo / beside, ratio | quiet / noisy goodput tok/s "
              "| Jain (fair share) | Jain (raw) | noisy rejected |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode in MODES:
        f = modes.get(mode, {}).get("fairness")
        if f is None:
            continue
        q, n = f["keys"].get("quiet", {}), f["keys"].get("noisy", {})
        lines.append(f"| {mode} | {_v(f['solo'].get('ttft_p95_ms'))} ms | {_v(q.get('ttft_p95_ms'))} ms "
                     f"| {_v(f['quiet_ttft_vs_solo'], '{:.2f}')} "
                     f"| {_v(f['solo'].get('front_door_ttft_p95_ms'))} / "
                     f"{_v(q.get('front_door_ttft_p95_ms'))} ms, "
                     f"{_v(f.get('quiet_door_ttft_vs_solo'), '{:.2f}')} "
                     f"| {_v(q.get('goodput_tok_s'))} / "
                     f"{_v(n.get('goodput_tok_s'))} | {_v(f['jain_fair_share'], '{:.3f}')} "
                     f"| {_v(f['jain_raw'], '{:.3f}')} | {n.get('rejected', 0)} of {n.get('requests', 0)} |")
    lines += ["", "## (c) Throughput", "", "| load | output tok/s off | on | on / off (≥ 0.95) |",
              "| --- | --- | --- | --- |"]
    for m in MULTIPLES:
        off = modes.get("off", {}).get("levels", {}).get(str(m), {}).get("total_output_tok_s")
        on = modes.get("on", {}).get("levels", {}).get(str(m), {}).get("total_output_tok_s")
        each = ratios(doc.get("runs", []), str(m))
        ratio = statistics.median(each) if each else (on / off if on is not None and off else None)
        lines.append(f"| {m}x | {_v(off)} | {_v(on)} | {_v(ratio, '{:.2f}')} |")
    runs = [r for r in doc.get("runs", []) if len(r["modes"]) == len(MODES)]  # complete repeats
    for m in MULTIPLES:
        first = [x for r in runs if r["order"][0] == "on" for x in ratios([r], str(m))]
        second = [x for r in runs if r["order"][0] != "on" for x in ratios([r], str(m))]
        if first and second:
            lines.append(f"| {m}x, the queue's run first / second | | | "
                         f"{statistics.median(first):.2f} / {statistics.median(second):.2f} |")
    if len(runs) > 1:
        lines += ["", "Each repeat (order; on/off tokens/s at 2x, 4x; the quiet key's p95 vs solo "
                  "off / on, the client's clock then the front door's; Jain (fair share) off / on):", ""]
        for i, r in enumerate(runs, 1):
            fr = {mode: r["modes"].get(mode, {}).get("fairness") or {} for mode in MODES}
            lines.append(
                f"- {i}: {', '.join(r['order'])}; "
                + ", ".join(_v(x, "{:.2f}") for m in MULTIPLES for x in ratios([r], str(m)))
                + "; " + " / ".join(_v(fr[mode].get("quiet_ttft_vs_solo"), "{:.2f}") for mode in MODES)
                + ", " + " / ".join(_v(fr[mode].get("quiet_door_ttft_vs_solo"), "{:.2f}") for mode in MODES)
                + "; " + " / ".join(_v(fr[mode].get("jain_fair_share"), "{:.3f}") for mode in MODES))
    return "\n".join(lines) + "\n"


def mode_names(doc: Mapping[str, Any]) -> dict[str, str]:
    """The modes' names in the chart: an A/A run's "on" is a second "off"."""
    if doc.get("aa"):
        return {"off": "queue off (A)", "on": "queue off (B)"}
    return {m: f"queue {m}" for m in MODES}


def plot(doc: Mapping[str, Any], out: Path) -> Path:
    """Three panels: premium and batch TTFT p95 per load (off/on), the quiet key's TTFT p95 (solo,
    beside noisy), output tokens/s per load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = doc["modes"]
    name = mode_names(doc)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4.2))
    labels = [f"{m}x" for m in MULTIPLES]
    width = 0.2
    for j, (mode, tier) in enumerate((("off", "premium"), ("on", "premium"), ("off", "batch"), ("on", "batch"))):
        ys = [modes.get(mode, {}).get("levels", {}).get(str(m), {}).get("tiers", {}).get(tier, {})
              .get("ttft_p95_ms") or 0 for m in MULTIPLES]
        ax1.bar([i + (j - 1.5) * width for i in range(len(MULTIPLES))], ys, width, label=f"{tier}, {name[mode]}")
    ax1.axhline(doc["objectives_ms"]["premium"], color="red", ls="--", lw=1, label="premium objective")
    ax1.set_yscale("log")
    ax1.set_xticks(range(len(MULTIPLES)), labels)
    ax1.set_ylabel("TTFT p95, ms (log)")
    ax1.set_title("(a) tiers under overload", fontsize=9)
    ax1.legend(fontsize=7)
    for j, mode in enumerate(MODES):
        f = modes.get(mode, {}).get("fairness") or {}
        ys = [f.get("solo", {}).get("ttft_p95_ms") or 0,
              f.get("keys", {}).get("quiet", {}).get("ttft_p95_ms") or 0]
        ax2.bar([i + (j - 0.5) * 0.35 for i in range(2)], ys, 0.35, label=f"{name[mode]} "
                f"(Jain {_v(f.get('jain_fair_share'), '{:.2f}')})")
    ax2.set_xticks(range(2), ["quiet alone", "quiet beside noisy"])
    ax2.set_ylabel("quiet key's TTFT p95, ms")
    ax2.set_title("(b) fairness", fontsize=9)
    ax2.legend(fontsize=7)
    for j, mode in enumerate(MODES):
        ys = [modes.get(mode, {}).get("levels", {}).get(str(m), {}).get("total_output_tok_s") or 0
              for m in MULTIPLES]
        ax3.bar([i + (j - 0.5) * 0.35 for i in range(len(MULTIPLES))], ys, 0.35, label=name[mode])
    ax3.set_xticks(range(len(MULTIPLES)), labels)
    ax3.set_ylabel("output tokens/s")
    ax3.set_title("(c) throughput", fontsize=9)
    ax3.legend(fontsize=7)
    for ax in (ax1, ax2, ax3):
        ax.grid(axis="y", alpha=0.3)
    what = "A/A run, the queue off in both modes" if doc.get("aa") else "gateway flow queue on vs off"
    fig.suptitle(f"{what} ({doc['timestamp']}, shared 2-core machine)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def parse_users(text: str) -> list[int]:
    users = [int(x) for x in text.split(",") if x.strip()]
    if not users or min(users) < 1:
        raise argparse.ArgumentTypeError(f"users must be positive integers, not {text!r}")
    return users


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench.flow", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per measured level")
    p.add_argument("--search-users", type=parse_users, default=[4, 8, 12, 16, 24, 32, 48, 64])
    p.add_argument("--search-duration", type=float, default=20.0)
    p.add_argument("--base-users", type=int, default=None, help="skip the search: L is this")
    p.add_argument("--premium-share", type=float, default=0.25)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--backoff", type=float, default=1.0, help="a user's wait after a 429/503")
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--key-limits", choices=("lifted", "tier"), default="lifted",
                   help="lifted: the bench keys' RPM, TPM and concurrency limits are overridden "
                        "(the load reaches the engine); tier: each key keeps its tier's limits")
    p.add_argument("--load-workers", type=int, default=4,
                   help="processes the users are spread over (loadtests.bench.loadgen)")
    p.add_argument("--repeats", type=int, default=4,
                   help="runs of both modes, the order alternating (even: each mode first as "
                        "often); the report gives medians")
    p.add_argument("--fair-tier", default="standard")
    p.add_argument("--noisy", type=int, default=32)
    p.add_argument("--quiet", type=int, default=2)
    p.add_argument("--results-dir", default=str(ROOT / "results" / "bench"))
    p.add_argument("--aa", action="store_true",
                   help="an A/A run: the queue off in both modes, so on/off measures the method's "
                        "own noise (the order, the machine)")
    p.add_argument("--render", metavar="JSON", default=None,
                   help="run nothing: write the .md and .png of an earlier run's JSON again")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.render:
        return render(Path(ns.render))
    run = procs.new_run("flow", "loadtests.bench.flow", ns.config, ns.results_dir, argv)
    objectives: dict[str, Objective] = read_objectives(run.config)
    for tier in ("premium", "batch", ns.fair_tier):
        if tier not in objectives:
            raise SystemExit(f"{run.config}: no tier {tier!r}")
    objective_ms = {t: o.ttft_p95_ms for t, o in objectives.items()}
    prompts = load_prompts()
    workdir = Path(tempfile.mkdtemp(prefix="serve-app-flow-"))
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    runs: list[dict[str, Any]] = []
    base = ns.base_users
    gen = LoadGen(ns.load_workers)
    try:
        for r in range(ns.repeats):
            order = MODES if r % 2 == 0 else MODES[::-1]
            runs.append({"order": list(order), "modes": {}})
            for mode in order:
                say(f"repeat {r + 1} of {ns.repeats}: queue {mode}")
                got = run_mode(gen, mode, ns, run.config, workdir / f"r{r}", prompts, objective_ms, base)
                runs[-1]["modes"][mode] = got
                base = got["base_users"]
    finally:
        gen.close()
        doc = {"command": run.command, "timestamp": run.stamp, "config": str(ns.config),
               "load_workers": ns.load_workers, "base_users": base, "premium_share": ns.premium_share, "max_tokens": ns.max_tokens,
               "duration_s": ns.duration, "noisy": ns.noisy, "quiet": ns.quiet,
               "fair_tier": ns.fair_tier, "key_limits": ns.key_limits, "aa": ns.aa,
               "objectives_ms": objective_ms, "runs": runs, "workdir": str(workdir)}
        report(doc, run.base)
    return 0


def report(doc: dict[str, Any], base: Path) -> None:
    """``doc``'s medians over its complete repeats, then ``base``.json, .md and .png (none
    without a finished mode)."""
    runs = doc["runs"]
    for r in runs:  # a run written before a figure was added gets it from its own summaries
        for got in r["modes"].values():
            f = got.get("fairness")
            if f and "quiet_door_ttft_vs_solo" not in f:
                f["quiet_door_ttft_vs_solo"] = quiet_vs_solo(f["solo"], f["keys"], "front_door_ttft_p95_ms")
    complete = [r for r in runs if len(r["modes"]) == len(MODES)] or runs
    doc["modes"] = median_tree([r["modes"] for r in complete]) or {}
    doc["repeats"] = len(complete)
    if doc["modes"]:
        procs.write_results(base, doc, markdown(doc))
        say(f"wrote {plot(doc, base.with_suffix('.png'))}")


def render(path: Path) -> int:
    """The report of an earlier run written again from its JSON (after a change to the report)."""
    report(json.loads(path.read_text()), path.with_suffix(""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

