"""Does a Batch API job fill idle capacity without hurting the interactive tiers? (issue 26)

``python -m loadtests.bench.batch`` starts the stack (configs/local.yaml) and, in the same run:

1. runs the README's locust load alone (``-u 12 -r 4`` for ``--duration`` seconds);
2. submits a ``--lines``-line chat batch through the openai SDK (files.create, batches.create),
   waits until its runner answers lines, and runs the same locust load again while it runs.

It reports, per phase, locust's interactive premium TTFT p95 and output tokens/s, and, for the
second phase, the batch's own output tokens in the window (``usage.output_tokens`` read from
batches.retrieve at the window's start and end). The ratios are the issue's: premium TTFT p95
(batch / alone, target at most 1.15) and total output tokens/s ((locust + batch) / alone, target
at least 1.3). The batch is cancelled at the end (its finished lines are kept).

The batch tier's per-key rpm (300 in configs/local.yaml) would cap the batch at 5 lines/s, so the
bench raises it (``--batch-rpm``); everything else is the config as shipped. Results:
``docs/perf/batch.{md,png}`` and ``results/bench/batch-<timestamp>.json``. Traffic goes to
127.0.0.1 only. The machine (2 cores) may be shared: compare the ratios, never absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtests.bench.procs import say
from loadtests.harness import stack as harness
from loadtests.harness.stack import ROOT, Stack

TIERS = ("premium", "standard", "batch")
LOCUSTFILE = ROOT / "loadtests" / "locustfile.py"
DOCS = ROOT / "docs" / "perf"
TTFT_TARGET, TOKENS_TARGET = 1.15, 1.3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench.batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--lines", type=int, default=1000, help="lines in the batch")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each batch line")
    p.add_argument("--users", type=int, default=12)
    p.add_argument("--spawn-rate", type=int, default=4)
    p.add_argument("--duration", type=int, default=120, help="seconds of locust per phase")
    p.add_argument("--max-output-tokens", type=int, default=128,
                   help="the locust users' max output tokens")
    p.add_argument("--batch-rpm", type=int, default=6000, help="the batch tier's per-key rpm")
    p.add_argument("--concurrency", type=int, default=8,
                   help="gateway.batch.concurrency: lines of the batch in flight")
    p.add_argument("--results-dir", default=str(ROOT / "results" / "bench"))
    p.add_argument("--docs-dir", default=str(DOCS))
    return p.parse_args(argv)


def edit_for(ns: argparse.Namespace) -> Any:
    def edit(args: dict[str, Any]) -> None:
        batch = args["tiers"]["batch"]
        batch["key_limits"] = {**batch.get("key_limits", {}), "rpm": ns.batch_rpm}
        args["gateway"]["batch"] = {"concurrency": ns.concurrency}
    return edit


def run_locust(stack: Stack, ns: argparse.Namespace, keys: dict[str, str], out: Path,
               on_ramp: Any = None) -> dict[str, Any]:
    """The README's locust load, headless, to the end; its --sla-json, plus the ramp time."""
    env = {**os.environ, **{f"SERVE_APP_KEY_{t.upper()}": keys[t] for t in TIERS}}
    argv = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", stack.root_url,
            "--headless", "-u", str(ns.users), "-r", str(ns.spawn_rate), "-t", f"{ns.duration}s",
            "--only-summary", "--app-config", str(stack.config), "--sla-json", str(out),
            "--max-output-tokens", str(ns.max_output_tokens)]
    proc = harness.spawn(f"locust {out.stem}", argv, out.with_suffix(".log"), env=env)
    started = None
    deadline = time.monotonic() + ns.duration + 300
    while proc.alive():
        if started is None and "Ramping to" in proc.log_tail(20_000):
            started = time.time()
            if on_ramp is not None:
                on_ramp()
        if time.monotonic() > deadline:
            harness.stop(proc)
            break
        time.sleep(0.5)
    ended = time.time()
    if not out.exists():
        raise RuntimeError(f"locust wrote no result; log {proc.log}:\n{proc.log_tail()}")
    doc: dict[str, Any] = json.loads(out.read_text())
    doc["window"] = (started or ended - ns.duration, ended)
    return doc


def premium_ttft(doc: dict[str, Any]) -> float | None:
    value = _tier(doc, "premium").get("ttft_p95_ms")
    return float(value) if value is not None else None


def batch_lines(n: int, max_tokens: int) -> bytes:
    topics = ("the sea", "a city at night", "bread", "winter", "a quiet library", "trains")
    return b"\n".join(json.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "tiny-chat", "max_tokens": max_tokens,
                 "messages": [{"role": "user", "content": f"Write about {topics[i % 6]} ({i})."}]},
    }).encode() for i in range(n)) + b"\n"


def measure(stack: Stack, ns: argparse.Namespace, work: Path) -> dict[str, Any]:
    import openai

    keys = {t: stack.keys[f"load-{t}"] for t in TIERS}
    say(f"phase 1: locust alone, -u {ns.users} for {ns.duration} s")
    alone = run_locust(stack, ns, keys, work / "alone.json")

    sdk = openai.OpenAI(base_url=stack.base_url, api_key=stack.keys["batch-user"])
    f = sdk.files.create(file=("bench.jsonl", batch_lines(ns.lines, ns.max_tokens)), purpose="batch")
    batch = sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    say(f"phase 2: batch {batch.id} ({ns.lines} lines) submitted; waiting for its first lines")
    deadline = time.monotonic() + 120
    while True:
        b = sdk.batches.retrieve(batch.id)
        if b.request_counts is not None and b.request_counts.completed >= 5:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the batch answered no lines in 120 s: {b}")
        time.sleep(0.5)
    marks: dict[str, Any] = {}

    def at_ramp() -> None:
        marks["start"] = sdk.batches.retrieve(batch.id)

    say(f"phase 2: locust with the batch running, -u {ns.users} for {ns.duration} s")
    mixed = run_locust(stack, ns, keys, work / "with-batch.json", on_ramp=at_ramp)
    end = sdk.batches.retrieve(batch.id)
    start = marks.get("start", b)
    window_s = mixed["window"][1] - mixed["window"][0]
    batch_tokens = (end.usage.output_tokens if end.usage else 0) - (
        start.usage.output_tokens if start.usage else 0)
    lines_done = (end.request_counts.completed if end.request_counts else 0) - (
        start.request_counts.completed if start.request_counts else 0)
    if end.status not in ("completed", "failed", "cancelled", "expired"):
        sdk.batches.cancel(batch.id)
    finished = end.status
    p_alone, p_mixed = premium_ttft(alone), premium_ttft(mixed)
    tok_alone = float(alone.get("output_tokens_per_s") or 0.0)
    tok_mixed_locust = float(mixed.get("output_tokens_per_s") or 0.0)
    tok_batch = batch_tokens / window_s if window_s > 0 else 0.0
    return {
        "alone": {"premium_ttft_p95_ms": p_alone, "output_tokens_per_s": tok_alone,
                  "tiers": alone.get("tiers")},
        "with_batch": {"premium_ttft_p95_ms": p_mixed, "locust_output_tokens_per_s": tok_mixed_locust,
                       "batch_output_tokens_per_s": tok_batch,
                       "total_output_tokens_per_s": tok_mixed_locust + tok_batch,
                       "batch_lines_in_window": lines_done, "window_s": window_s,
                       "batch_status_at_end": finished, "tiers": mixed.get("tiers")},
        "ratios": {
            "premium_ttft_p95": (p_mixed / p_alone) if p_alone and p_mixed else None,
            "total_output_tokens_per_s": ((tok_mixed_locust + tok_batch) / tok_alone)
            if tok_alone else None,
        },
    }


def _f(v: float | None, digits: int = 0, suffix: str = "") -> str:
    return "-" if v is None else f"{v:,.{digits}f}{suffix}"


def markdown(doc: dict[str, Any], command: str) -> str:
    a, m, r = doc["alone"], doc["with_batch"], doc["ratios"]
    ttft_ok = r["premium_ttft_p95"] is not None and r["premium_ttft_p95"] <= TTFT_TARGET
    tok_ok = (r["total_output_tokens_per_s"] is not None
              and r["total_output_tokens_per_s"] >= TOKENS_TARGET)
    return "\n".join([
        "# Batch API on the batch tier: interactive latency and total throughput",
        "",
        f"Made by `{command}` on {doc['date']} (2 cores, **shared with other jobs while it ran**: "
        "compare the ratios, not the absolute times). One stack, one run: the README's locust "
        f"load (-u {doc['users']}, {doc['duration_s']} s) alone, then the same load while a "
        f"{doc['lines']}-line chat batch (max_tokens {doc['max_tokens']}) ran at the batch tier "
        f"(gateway.batch.concurrency {doc['concurrency']}, batch key rpm {doc['batch_rpm']}).",
        "",
        "| | locust alone | locust + batch | ratio | target |",
        "|---|---|---|---|---|",
        f"| premium TTFT p95 (locust) | {_f(a['premium_ttft_p95_ms'], 0, ' ms')} "
        f"| {_f(m['premium_ttft_p95_ms'], 0, ' ms')} | {_f(r['premium_ttft_p95'], 2, 'x')} "
        f"| <= {TTFT_TARGET}x {'(met)' if ttft_ok else '(missed)'} |",
        f"| output tokens/s, locust | {_f(a['output_tokens_per_s'])} "
        f"| {_f(m['locust_output_tokens_per_s'])} | | |",
        f"| output tokens/s, batch | - | {_f(m['batch_output_tokens_per_s'])} | | |",
        f"| output tokens/s, total | {_f(a['output_tokens_per_s'])} "
        f"| {_f(m['total_output_tokens_per_s'])} | {_f(r['total_output_tokens_per_s'], 2, 'x')} "
        f"| >= {TOKENS_TARGET}x {'(met)' if tok_ok else '(missed)'} |",
        "",
        f"The batch answered {m['batch_lines_in_window']} lines in the {m['window_s']:.0f} s "
        f"window; at the end it was {m['batch_status_at_end']} (then cancelled, its lines kept).",
        "",
        "Per tier (locust's p95s, which it rounds to 10 ms buckets above 100 ms):",
        "",
        "| tier | requests alone / + batch | TTFT p95 alone / + batch | TPOT p95 alone / + batch |",
        "|---|---|---|---|",
        *(f"| {t} | {a_t.get('requests', '-')} / {m_t.get('requests', '-')} "
          f"| {_f(a_t.get('ttft_p95_ms'), 0, ' ms')} / {_f(m_t.get('ttft_p95_ms'), 0, ' ms')} "
          f"| {_f(a_t.get('tpot_p95_ms'), 0, ' ms')} / {_f(m_t.get('tpot_p95_ms'), 0, ' ms')} |"
          for t in TIERS
          for a_t, m_t in [(_tier(a, t), _tier(m, t))]),
        "",
        "![batch](batch.png)",
        "",
    ])


def _tier(phase: dict[str, Any], tier: str) -> dict[str, Any]:
    return next((t for t in phase.get("tiers") or [] if t.get("tier") == tier), {})


def plot(doc: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, m = doc["alone"], doc["with_batch"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(["alone", "+ batch"], [a["premium_ttft_p95_ms"] or 0, m["premium_ttft_p95_ms"] or 0],
            color=["tab:blue", "tab:orange"])
    ax1.axhline((a["premium_ttft_p95_ms"] or 0) * TTFT_TARGET, color="red", ls="--",
                label=f"{TTFT_TARGET}x alone")
    ax1.set_ylabel("premium TTFT p95, ms (lower is better)")
    ax1.legend(fontsize=8)
    ax2.bar(["alone"], [a["output_tokens_per_s"]], color="tab:blue", label="locust")
    ax2.bar(["+ batch"], [m["locust_output_tokens_per_s"]], color="tab:blue")
    ax2.bar(["+ batch"], [m["batch_output_tokens_per_s"]], bottom=[m["locust_output_tokens_per_s"]],
            color="tab:green", label="batch")
    ax2.axhline(a["output_tokens_per_s"] * TOKENS_TARGET, color="red", ls="--",
                label=f"{TOKENS_TARGET}x alone")
    ax2.set_ylabel("output tokens/s (higher is better)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{doc['lines']}-line chat batch beside the README's locust load "
                 f"(-u {doc['users']}, {doc['duration_s']} s per phase; shared 2-core machine)",
                 fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    command = "python -m loadtests.bench.batch " + " ".join(argv if argv is not None else sys.argv[1:])
    keys = {f"load-{t}": (t, ["*"]) for t in TIERS} | {"batch-user": ("batch", ["*"])}
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        work = Path(tmp)
        stack = harness.start_stack(ROOT / ns.config, work, keys=keys, edit=edit_for(ns),
                                    retries=1)
        try:
            doc = measure(stack, ns, work)
        finally:
            stack.stop()
    doc.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), users=ns.users,
               duration_s=ns.duration, lines=ns.lines, max_tokens=ns.max_tokens,
               concurrency=ns.concurrency, batch_rpm=ns.batch_rpm, command=command)
    results = Path(ns.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"batch-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps(doc, indent=2))
    docs = Path(ns.docs_dir)
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "batch.md").write_text(markdown(doc, command))
    plot(doc, docs / "batch.png")
    print(markdown(doc, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
