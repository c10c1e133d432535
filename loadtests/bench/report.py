"""Pure functions of the benchmark: metrics of one run, the loss checks, medians and the tables."""

from __future__ import annotations

import statistics
from typing import Any

SIDES = ("direct", "gateway")
# --peers adds these sides (loadtests.bench.peers); every side is compared with "direct".
PEER_SIDES = ("rayserve", "litellm")
SIDE_NAMES = {
    "direct": "direct vLLM",
    "gateway": "this gateway",
    "rayserve": "Ray Serve LLM",
    "litellm": "LiteLLM proxy",
}

# (key in our metrics, column title, format)
COLUMNS = (
    ("output_tok_s", "Output tok/s", "{:.0f}"),
    ("req_s", "Req/s", "{:.2f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.1f}"),
    ("tpot_p50_ms", "TPOT p50 ms", "{:.2f}"),
    ("tpot_p99_ms", "TPOT p99 ms", "{:.2f}"),
    ("total_output_tokens", "Output tokens", "{:.0f}"),
    ("frontend_cpu_per_1k", "Front-end CPU-s per 1k tok", "{:.3f}"),
)
TIMED = tuple(k for k, _, _ in COLUMNS if k != "total_output_tokens")


def run_metrics(result: dict[str, Any]) -> dict[str, Any]:
    """The numbers we keep from one ``vllm.benchmarks.serve`` result (``--save-detailed``)."""
    errors = [e for e in result.get("errors") or [] if e]
    texts = result.get("generated_texts") or []
    return {
        "completed": int(result.get("completed", 0)),
        "failed": int(result.get("failed", 0)),
        "total_input_tokens": int(result.get("total_input_tokens", 0)),
        "total_output_tokens": int(result.get("total_output_tokens", 0)),
        "delivered_text_chars": sum(len(t or "") for t in texts),
        "duration_s": float(result.get("duration", 0.0)),
        "output_tok_s": float(result.get("output_throughput", 0.0)),
        "req_s": float(result.get("request_throughput", 0.0)),
        "ttft_p50_ms": float(result.get("p50_ttft_ms", result.get("median_ttft_ms", 0.0))),
        "ttft_p99_ms": float(result.get("p99_ttft_ms", 0.0)),
        "tpot_p50_ms": float(result.get("p50_tpot_ms", result.get("median_tpot_ms", 0.0))),
        "tpot_p99_ms": float(result.get("p99_tpot_ms", 0.0)),
        "itl_p50_ms": float(result.get("p50_itl_ms", result.get("median_itl_ms", 0.0))),
        "e2el_p50_ms": float(result.get("p50_e2el_ms", result.get("median_e2el_ms", 0.0))),
        "errors": sorted(set(e.strip().splitlines()[-1][:300] for e in errors))[:3],
        # Filled by ``add_cpu`` once the run's CPU is known; None when no server was accounted.
        "frontend_cpu_s": None,
        "engine_cpu_s": None,
        "frontend_cpu_per_1k": None,
    }


CLIENT = "benchmark client"


def is_engine(label: str) -> bool:
    """vLLM's engine processes (``VLLM::EngineCore``, ``VLLM::Worker``): the same on every side."""
    return label.upper().startswith("VLLM::")


def add_cpu(m: dict[str, Any]) -> None:
    """Split a run's ``cpu_s`` (CPU seconds per process kind) into the engine's and the front end's
    (every other server process: vLLM's API server; the gateway, model replica, HAProxy and Ray's
    own processes; a proxy), and the front end's per 1,000 output tokens, the figure that compares
    what each side spends around the same engine. Call it after the output tokens are final (a
    peer's are corrected by the engine's count). Without server processes (an external stack
    whose processes were not found) the three stay None."""
    servers = {k: v for k, v in (m.get("cpu_s") or {}).items() if k != CLIENT}
    if not servers:
        return
    front = sum(v for k, v in servers.items() if not is_engine(k))
    m["frontend_cpu_s"] = round(front, 2)
    m["engine_cpu_s"] = round(sum(servers.values()) - front, 2)
    tokens = m.get("total_output_tokens") or 0
    m["frontend_cpu_per_1k"] = front * 1000.0 / tokens if tokens else None


def cpu_delta(before: dict[str, float], after: dict[str, float],
              floor: float = 0.05) -> dict[str, float]:
    """CPU seconds used between two ``procs.cpu_seconds`` readings, per process kind, largest
    first; kinds below ``floor`` are left out (a process that only existed at one reading counts
    from zero)."""
    used = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items() if v - before.get(k, 0.0) >= floor}
    return dict(sorted(used.items(), key=lambda kv: -kv[1]))


def failed_run(message: str) -> dict[str, Any]:
    """The metrics of a run that raised or timed out: nothing completed."""
    m = run_metrics({})
    m["errors"] = [message[:300]]
    return m


def check_pair(direct: dict[str, Any], gateway: dict[str, Any], num_prompts: int,
               output_len: int) -> list[str]:
    """Problems of one (direct, gateway) pair of runs over the same prompts. Empty means fine."""
    problems = []
    expected_tokens = num_prompts * output_len
    for side, m in (("direct", direct), ("gateway", gateway)):
        if m["failed"] or m["completed"] != num_prompts:
            problems.append(
                f"{side}: {m['completed']}/{num_prompts} requests completed, {m['failed']} failed"
                + (f" ({'; '.join(m['errors'])})" if m["errors"] else "")
            )
        if m["total_output_tokens"] != expected_tokens:
            problems.append(
                f"{side}: {m['total_output_tokens']} output tokens, expected {expected_tokens} "
                f"({num_prompts} x {output_len} with ignore_eos)"
            )
    if direct["completed"] != gateway["completed"]:
        problems.append(
            f"completed requests differ: direct {direct['completed']}, gateway {gateway['completed']}"
        )
    if direct["total_output_tokens"] != gateway["total_output_tokens"]:
        problems.append(
            f"output tokens differ: direct {direct['total_output_tokens']}, "
            f"gateway {gateway['total_output_tokens']} "
            f"({gateway['total_output_tokens'] - direct['total_output_tokens']:+d})"
        )
    if direct["completed"] == gateway["completed"] and (
        direct["total_input_tokens"] != gateway["total_input_tokens"]
    ):
        problems.append(
            f"prompt tokens differ (direct {direct['total_input_tokens']}, gateway "
            f"{gateway['total_input_tokens']}): the sides did not get the same prompts"
        )
    return problems


def check_sides(pair: dict[str, dict[str, Any]], num_prompts: int, output_len: int) -> list[str]:
    """``check_pair`` of every side against direct vLLM (a side's own problems reported once)."""
    problems: list[str] = []
    for side, m in pair.items():
        if side == "direct":
            continue
        for p in check_pair(pair["direct"], m, num_prompts, output_len):
            p = p.replace("gateway", side)
            if p.startswith("direct:") and p in problems:
                continue
            problems.append(p)
    return problems


def text_agreement(direct_texts: list[str], gateway_texts: list[str]) -> tuple[int, int]:
    """(identical, total) streamed texts, request by request (greedy decoding, same prompts)."""
    same = sum(1 for a, b in zip(direct_texts, gateway_texts, strict=False) if a == b)
    return same, max(len(direct_texts), len(gateway_texts))


def medians(runs: list[dict[str, Any]], concurrencies: list[int],
            sides: tuple[str, ...] = SIDES) -> dict[int, dict[str, Any]]:
    """{concurrency: {side: {metric: median over repeats}}}."""
    out: dict[int, dict[str, Any]] = {}
    for c in concurrencies:
        out[c] = {}
        for side in sides:
            ms = [r["metrics"] for r in runs if r["concurrency"] == c and r["side"] == side]
            if not ms:
                continue
            med: dict[str, Any] = {k: _median([m.get(k) for m in ms]) for k, _, _ in COLUMNS}
            labels = sorted({k for m in ms for k in m.get("cpu_s", {})})
            med["cpu_s"] = {k: statistics.median(m.get("cpu_s", {}).get(k, 0.0) for m in ms)
                            for k in labels}
            med["repeats"] = len(ms)
            med["total_output_tokens_all_repeats"] = sum(m["total_output_tokens"] for m in ms)
            med["completed_all_repeats"] = sum(m["completed"] for m in ms)
            med["failed_all_repeats"] = sum(m["failed"] for m in ms)
            out[c][side] = med
    return out


def _median(values: list[Any]) -> float | None:
    """The median of the numbers among ``values`` (a run without CPU figures has None)."""
    nums = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(nums) if nums else None


def ratios(summary: dict[int, dict[str, Any]], side: str = "gateway") -> dict[int, dict[str, float]]:
    """``side`` (the gateway by default) against direct, per concurrency, from the medians."""
    out: dict[int, dict[str, float]] = {}
    for c, sides in summary.items():
        d, g = sides.get("direct"), sides.get(side)
        if not d or not g:
            continue
        out[c] = {
            "tok_s_ratio": g["output_tok_s"] / d["output_tok_s"] if d["output_tok_s"] else 0.0,
            "ttft_p50_delta_ms": g["ttft_p50_ms"] - d["ttft_p50_ms"],
            "ttft_p50_ratio": g["ttft_p50_ms"] / d["ttft_p50_ms"] if d["ttft_p50_ms"] else 0.0,
            "tpot_p50_ratio": g["tpot_p50_ms"] / d["tpot_p50_ms"] if d["tpot_p50_ms"] else 0.0,
        }
    return out


def _fmt(fmt: str, v: Any) -> str:
    return fmt.format(v) if isinstance(v, (int, float)) else "n/a"


def markdown(summary: dict[int, dict[str, Any]], rat: dict[int, dict[str, float]],
             rss_bytes: int | None, meta: dict[str, Any]) -> str:
    lines = [
        f"Medians over {meta['repeats']} repeat(s); `{meta['backend']}` backend (streaming "
        f"`{meta['endpoint']}`), random dataset, input {meta['input_len']} / output "
        f"{meta['output_len']} tokens (`--ignore-eos`), seed {meta['seed']}, greedy. The stack "
        f"runs `{meta.get('config', 'configs/local.yaml')}` as shipped, with the benchmark's key "
        f"in an unlimited tier.",
        "",
        "| Concurrency | Prompts | Side | " + " | ".join(t for _, t, _ in COLUMNS) + " |",
        "| ---: | ---: | --- | " + " | ".join("---:" for _ in COLUMNS) + " |",
    ]
    for c, sides in summary.items():
        for side in sides:
            m = sides.get(side)
            if m is None:
                continue
            cells = " | ".join(_fmt(f, m[k]) for k, _, f in COLUMNS)
            lines.append(f"| {c} | {meta['num_prompts'][str(c)]} | {side} | {cells} |")
    lines += [
        "",
        "| Concurrency | tok/s gateway/direct | TTFT p50 gateway/direct | TTFT p50 gateway - direct (ms) | TPOT p50 gateway/direct |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for c, r in rat.items():
        lines.append(
            f"| {c} | {r['tok_s_ratio']:.2f} | {r.get('ttft_p50_ratio', 0.0):.2f} | "
            f"{r['ttft_p50_delta_ms']:+.1f} | {r['tpot_p50_ratio']:.2f} |"
        )
    cpu_rows = [
        (c, side, m) for c, sides in summary.items() for side in sides
        if (m := sides.get(side)) and len(m.get("cpu_s", {})) > 1
    ]
    if cpu_rows:
        lines += [
            "",
            "CPU seconds per 1,000 output tokens (median run; server processes and the benchmark client):",
            "",
            "| Concurrency | Side | Servers total | Largest server processes | Client |",
            "| ---: | --- | ---: | --- | ---: |",
        ]
        for c, side, m in cpu_rows:
            per_k = 1000.0 / m["total_output_tokens"] if m["total_output_tokens"] else 0.0
            servers = {k: v * per_k for k, v in m["cpu_s"].items() if k != CLIENT}
            top = sorted(servers.items(), key=lambda kv: -kv[1])[:4]
            lines.append(
                f"| {c} | {side} | {sum(servers.values()):.2f} | "
                + ", ".join(f"{k} {v:.2f}" for k, v in top)
                + f" | {m['cpu_s'].get(CLIENT, 0.0) * per_k:.2f} |"
            )
    lines.append("")
    heads = []
    for c in (16, 64):
        if c in rat:
            heads.append(f"tokens/s ratio gateway/direct at c{c}: **{rat[c]['tok_s_ratio']:.2f}**")
    if 1 in rat:
        heads.append(f"TTFT p50 delta at c1: **{rat[1]['ttft_p50_delta_ms']:+.1f} ms**")
    highest = max(summary) if summary else None
    if highest is not None:
        front = {side: m.get("frontend_cpu_per_1k") for side, m in summary[highest].items()}
        if any(isinstance(v, (int, float)) for v in front.values()):
            heads.append(f"front-end CPU-s per 1,000 output tokens at c{highest}: " + ", ".join(
                f"{side} **{_fmt('{:.3f}', v)}**" for side, v in front.items()))
    lines += [f"- {h}" for h in heads]
    if rss_bytes is not None:
        lines.append(f"- gateway replica peak RSS: **{rss_bytes / 2**20:.0f} MiB**")
    else:
        lines.append("- gateway replica peak RSS: not measured (see the warning in the output)")
    return "\n".join(lines) + "\n"


def repeats_markdown(runs: list[dict[str, Any]]) -> str:
    """Every run: per concurrency and repeat, each side's tokens/s and TTFT p50, and the
    gateway's ratios against direct in that repeat (the paired figures behind the medians)."""
    by: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for r in runs:
        by.setdefault((r["concurrency"], r["repeat"]), {})[r["side"]] = r.get("metrics") or {}
    sides = sorted({s for v in by.values() for s in v}, key=lambda s: (s != "direct", s != "gateway", s))
    head = ["Concurrency", "Repeat", *(f"{s} tok/s, TTFT p50" for s in sides),
            "gateway/direct tok/s", "gateway/direct TTFT p50"]
    lines = ["Every repeat:", "", "| " + " | ".join(head) + " |",
             "| ---: | ---: |" + " ---: |" * (len(head) - 2)]
    for (c, rep), per in sorted(by.items()):
        cells = [f"{_fmt('{:.0f}', per.get(s, {}).get('output_tok_s'))}, "
                 f"{_fmt('{:.1f}', per.get(s, {}).get('ttft_p50_ms'))} ms" for s in sides]
        d, g = per.get("direct", {}), per.get("gateway", {})
        tok = (g.get("output_tok_s") or 0) / d["output_tok_s"] if d.get("output_tok_s") else None
        ttft = (g.get("ttft_p50_ms") or 0) / d["ttft_p50_ms"] if d.get("ttft_p50_ms") else None
        lines.append(f"| {c} | {rep} | " + " | ".join(cells)
                     + f" | {_fmt('{:.2f}', tok)} | {_fmt('{:.2f}', ttft)} |")
    return "\n".join(lines) + "\n"


def side_by_side(summary: dict[int, dict[str, Any]], sides: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per side but direct: its c1 TTFT p50 delta and tokens/s ratio at each concurrency."""
    rows = []
    for side in sides:
        if side == "direct":
            continue
        rat = ratios(summary, side)
        rows.append({
            "side": side,
            "name": SIDE_NAMES.get(side, side),
            "ttft_p50_delta_ms": {c: r["ttft_p50_delta_ms"] for c, r in rat.items()},
            "tok_s_ratio": {c: r["tok_s_ratio"] for c, r in rat.items()},
        })
    return rows


def side_by_side_markdown(summary: dict[int, dict[str, Any]], sides: tuple[str, ...]) -> str:
    """The README's table: each server against direct vLLM, from the medians of one run."""
    concs = list(summary)
    head = ["Server"] + [f"TTFT p50 vs direct, c{c}" for c in concs[:1]] + \
        [f"tok/s vs direct, c{c}" for c in concs]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    direct = [f"{summary[c]['direct']['output_tok_s']:.0f} tok/s" for c in concs if "direct" in summary[c]]
    if concs and "direct" in summary[concs[0]]:
        lines.append(f"| direct vLLM | {summary[concs[0]]['direct']['ttft_p50_ms']:.1f} ms | "
                     + " | ".join(direct) + " |")
    for row in side_by_side(summary, sides):
        cells = [f"{row['ttft_p50_delta_ms'][c]:+.1f} ms" for c in concs[:1] if c in row["ttft_p50_delta_ms"]]
        cells += [f"{row['tok_s_ratio'][c]:.2f}x" if c in row["tok_s_ratio"] else "n/a" for c in concs]
        lines.append(f"| {row['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cpu_per_1k(m: dict[str, Any]) -> dict[str, float]:
    """CPU seconds per 1,000 output tokens of each server process kind in one side's medians."""
    tokens = m.get("total_output_tokens") or 0
    if not tokens:
        return {}
    return {k: v * 1000.0 / tokens for k, v in sorted(m.get("cpu_s", {}).items(), key=lambda kv: -kv[1])
            if k != CLIENT}


def cpu_markdown(summary: dict[int, dict[str, Any]], c: int, sides: tuple[str, ...]) -> str:
    """CPU seconds per 1,000 output tokens at concurrency ``c``, per process kind and side."""
    if c not in summary:
        return ""
    lines = [f"| Side | Process | CPU-s per 1,000 output tokens (c{c}) |", "| --- | --- | ---: |"]
    for side in sides:
        m = summary[c].get(side)
        if not m:
            continue
        per = cpu_per_1k(m)
        for k, v in per.items():
            if v >= 0.005:
                lines.append(f"| {SIDE_NAMES.get(side, side)} | `{k}` | {v:.3f} |")
        front = sum(v for k, v in per.items() if not is_engine(k))
        lines.append(f"| {SIDE_NAMES.get(side, side)} | **front end (all but the engine's processes)** "
                     f"| **{front:.3f}** |")
    return "\n".join(lines) + "\n"


def fairness_markdown(runs: list[dict[str, Any]], settle_s: float | None) -> str:
    """How the run kept the sides from slowing each other, from what each run recorded: the engine
    processes live and suspended during each side's runs, and the CPU the other sides' processes
    used meanwhile. ``settle_s`` None means every engine stayed live (``--no-suspend``)."""
    sides = list(dict.fromkeys(r["side"] for r in runs))
    if settle_s is None:
        head = ("**Fairness: none.** Every side's vLLM engine stayed live during every run "
                "(`--no-suspend`), so an engine that had just served a run busy-waited into the next "
                "side's run.")
    else:
        head = (f"**Fairness.** Only the side under test had a live vLLM engine. Before each run, "
                "the engine processes of every other side (`VLLM::EngineCore` and its `VLLM::Worker`, "
                "found in each side's process tree) were suspended with SIGSTOP, the side's own "
                f"resumed with SIGCONT, and the run started {settle_s:g} s later. The LiteLLM "
                "proxy's engine is direct vLLM's. Front ends stayed up (idle), so the other sides' "
                "processes still used some CPU during a run (last column). Sides alternate (two) or "
                "rotate (more) at every step, so each goes first equally often.")
    lines = [head, "", "| Side | Engine processes live | Suspended (by side) | Other sides' CPU-s "
             "per run (median) |", "| --- | --- | --- | ---: |"]
    problems = []
    for side in sides:
        recs = [r["metrics"] for r in runs if r["side"] == side]
        eng = [m["engines"] for m in recs if m.get("engines")]
        live = sorted({e["live"] for e in eng})
        stopped: dict[str, set[int]] = {}
        for e in eng:
            for other, n in e["suspended"].items():
                stopped.setdefault(other, set()).add(n)
        if eng and not all(e["suspended_verified"] for e in eng):
            problems.append(f"{side}: a suspended engine was not seen stopped in some run")
        if eng and 0 in live:
            problems.append(f"{side}: no engine process found in some run (not isolated)")
        bg = _median([m.get("background_cpu_s") for m in recs])
        lines.append(
            f"| {side} | {'/'.join(map(str, live)) or 'all (none suspended)'} | "
            + (", ".join(f"{o} {'/'.join(map(str, sorted(n)))}" for o, n in stopped.items()) or "none")
            + f" | {_fmt('{:.2f}', bg)} |")
    lines += [""] + [f"- WARNING: {p}" for p in problems]
    return "\n".join(lines).rstrip("\n") + "\n"
