"""The simulated engine against the real one: the same benchmark on both, cell by cell (issue 39).

``python -m loadtests.bench.sim_validate`` (``make bench-sim-validate``) runs vLLM's own benchmark
(``vllm.benchmarks.serve``: streamed ``/v1/completions``, fixed output length, ``--ignore-eos``)
against two servers, one live at a time:

- **real**: plain vLLM's OpenAI server with the app's engine arguments for the model
  (``serve-app engine-args``, as ``make bench`` starts it; configs/local.yaml's tiny-chat as
  shipped, LoRA on, base-model requests), a real CPU engine;
- **sim**: ``serve-app sim-engine``, the same model's SIMULATED engine (serve_app/engine/sim, the
  ``cpu-tiny`` profile, time scale 1) served on its own with the same engine arguments and the
  real engine's platform defaults (block size, token budget, KV blocks) where the config sets none.

Both are compared engine against engine: no gateway, Ray or keys in front of either, so neither
figure carries a front end the other lacks (through the stack, the gateway's and Ray's CPU would
share the two cores with the real engine but not with the simulated one, which uses almost none).

The cells: c1, c16 and c64 of random prompts (``--input-len`` tokens each), and at
``--prefix-concurrency`` a prefix hit (every prompt the same ``--prefix-len``-token prefix, then
``--input-len`` tokens of its own) and a prefix miss (prompts of the same total length, each
unique). Prompts are token ids (the same ids on both sides, so both count and hash the same
tokens), made from a seed. Per cell and side: TTFT p50, TPOT p50 and output tokens/s (medians of
``--repeats``); the table gives sim / real per figure and marks those outside ±``--tolerance``.

``--real-only`` measures the real engine alone (the data ``python -m
serve_app.engine.sim.calibrate`` fits the ``cpu-tiny`` profile to); ``--real-from FILE`` takes the
real cells of an earlier result instead of measuring them (a sim-only run: say so when quoting it).

Results: ``results/bench/sim-validate-<timestamp>.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from loadtests.bench import procs, report, run
from loadtests.bench.procs import ROOT, say
from loadtests.harness import stack as harness

FIGURES = ("ttft_p50_ms", "tpot_p50_ms", "output_tok_s")
FIGURE_NAMES = {"ttft_p50_ms": "TTFT p50 (ms)", "tpot_p50_ms": "TPOT p50 (ms)", "output_tok_s": "output tok/s"}
# vLLM 0.32's defaults for its OpenAI server on the CPU platform where a config sets none:
# vllm/engine/arg_utils.py (max_num_batched_tokens 2048 on CPU) and vllm/platforms/cpu.py (KV
# blocks of 128 tokens). The block size and KV size are read back from the real engine's
# ``vllm:cache_config_info`` when it runs.
CPU_DEFAULTS = {"max_num_batched_tokens": 2048, "block_size": 128}
FIRST_ID = 16  # prompt ids from here to the vocabulary's end: no special tokens


@dataclass(frozen=True)
class Cell:
    """One benchmark cell (the same fields as serve_app.engine.sim.calibrate.Cell)."""

    name: str
    concurrency: int
    num_prompts: int
    input_len: int
    output_len: int
    prefix_len: int = 0
    warmups: int = 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench.sim_validate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--model", default="tiny-chat")
    p.add_argument("--profile", default="cpu-tiny", help="the simulated engine's step-time profile")
    p.add_argument("--concurrency", default="1,16,64", help="random-prompt cells")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=2048, help="shared prefix of the prefix-hit cell")
    p.add_argument("--prefix-concurrency", type=int, default=8)
    p.add_argument("--no-prefix", action="store_true", help="skip the prefix hit and miss cells")
    p.add_argument("--repeats", type=int, default=1, help="runs per side and cell (medians)")
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--real-only", action="store_true", help="measure the real engine only")
    p.add_argument("--real-from", help="take the real cells of this earlier result (.json)")
    p.add_argument("--run-timeout", type=float, default=900.0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--results-dir", default=str(ROOT / "results" / "bench"))
    ns = p.parse_args(argv)
    if ns.real_only and ns.real_from:
        p.error("--real-only and --real-from exclude each other")
    ns.backend = "openai"
    return ns


def cells_of(ns: argparse.Namespace) -> list[Cell]:
    """The cells: random prompts at each concurrency, then the prefix hit and miss."""
    out = [Cell(f"c{c}", c, max(32, 8 * c), ns.input_len, ns.output_len, warmups=min(c, 8))
           for c in (int(x) for x in str(ns.concurrency).split(",") if x.strip())]
    if not ns.no_prefix:
        c = ns.prefix_concurrency
        n = max(32, 8 * c)
        out += [Cell("prefix-hit", c, n, ns.input_len, ns.output_len, ns.prefix_len, min(c, 8)),
                Cell("prefix-miss", c, n, ns.prefix_len + ns.input_len, ns.output_len, 0, min(c, 8))]
    return out


def token_prompts(cell: Cell, vocab_size: int, seed: int, repeat: int = 0) -> list[list[int]]:
    """The cell's prompts as token ids: a shared prefix (``prefix_len``), then each prompt's own
    ``input_len`` ids, drawn from the vocabulary's ordinary ids with a seed of the cell's and the
    repeat's: a repeat must not find the previous one's prompts in the engine's prefix cache (the
    prefix-miss cell would be a hit from its second run on)."""
    rng = random.Random(f"{seed}-{cell.name}" + (f"-r{repeat}" if repeat else ""))
    low = min(FIRST_ID, vocab_size - 1)

    def draw(n: int) -> list[int]:
        return [rng.randrange(low, vocab_size) for _ in range(n)]

    prefix = draw(cell.prefix_len)
    return [prefix + draw(cell.input_len) for _ in range(cell.num_prompts)]


# ---- one benchmark run --------------------------------------------------------------------------------
def run_cell(ns: argparse.Namespace, side: str, url: str, model_id: str, model_path: str, cell: Cell,
             repeat: int, log: Path, stamp: str) -> dict[str, Any]:
    """One ``vllm.benchmarks.serve`` run of ``cell`` (its prompts as token ids), in this process."""
    import vllm.benchmarks.serve as bench
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def samples(args: argparse.Namespace, tokenizer: Any) -> list[Any]:
        return [SampleRequest(prompt=ids, prompt_len=len(ids), expected_output_len=cell.output_len,
                              request_id=f"{args.request_id_prefix}{i}")
                for i, ids in enumerate(token_prompts(cell, int(tokenizer.vocab_size), ns.seed, repeat))]

    argv = ["--backend", ns.backend, "--base-url", url, "--endpoint", "/v1/completions",
            "--model", model_id, "--tokenizer", model_path, "--dataset-name", "random",
            "--random-input-len", str(cell.prefix_len + cell.input_len),
            "--random-output-len", str(cell.output_len), "--num-prompts", str(cell.num_prompts),
            "--seed", str(ns.seed), "--max-concurrency", str(cell.concurrency), "--ignore-eos",
            "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--num-warmups", str(cell.warmups), "--disable-tqdm",
            "--request-id-prefix", f"simval-{stamp}-{side}-{cell.name}-r{repeat}-",
            "--label", f"{side}-{cell.name}-r{repeat}"]
    parser = FlexibleArgumentParser()
    bench.add_cli_args(parser)
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    try:
        with open(log, "a") as out, contextlib.redirect_stdout(out), \
                mock.patch.object(bench, "get_samples", samples):
            print(f"\n===== {side} {cell.name} repeat={repeat} =====", flush=True)
            result = asyncio.run(asyncio.wait_for(bench.main_async(args), ns.run_timeout))
        metrics = report.run_metrics(result)
    except TimeoutError:
        metrics = report.failed_run(f"run timed out after {ns.run_timeout:.0f} s")
    except Exception as exc:  # a run that raises counts as all requests failed
        metrics = report.failed_run(f"{type(exc).__name__}: {exc}")
    say(f"  {side:4} {cell.name:11} r{repeat}: {metrics['output_tok_s']:7.0f} tok/s  TTFT p50 "
        f"{metrics['ttft_p50_ms']:7.1f} ms  TPOT p50 {metrics['tpot_p50_ms']:6.2f} ms  "
        f"{metrics['completed']}/{cell.num_prompts} ok  ({time.monotonic() - t0:.0f} s)")
    for e in metrics["errors"]:
        say(f"    error: {e}")
    return metrics


def measure(ns: argparse.Namespace, side: str, url: str, model_id: str, model_path: str,
            cells: list[Cell], log: Path, stamp: str) -> dict[str, list[dict[str, Any]]]:
    """Every cell ``--repeats`` times on one side, the cells in turn within each repeat."""
    out: dict[str, list[dict[str, Any]]] = {c.name: [] for c in cells}
    for r in range(ns.repeats):
        for cell in cells:
            out[cell.name].append(run_cell(ns, side, url, model_id, model_path, cell, r, log, stamp))
    return out


def medians(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per cell, the median of each figure over its runs, and the failed requests summed."""
    return {name: {**{f: statistics.median(float(m[f]) for m in ms) for f in FIGURES},
                   "failed": sum(int(m.get("failed", 0)) for m in ms), "runs": len(ms)}
            for name, ms in runs.items()}


# ---- the two sides ------------------------------------------------------------------------------------
CACHE_INFO = re.compile(r'^vllm:cache_config_info\{(?P<labels>[^}]*)\}', re.MULTILINE)


def cache_config(metrics_text: str) -> dict[str, str]:
    """The labels of vLLM's ``vllm:cache_config_info`` (block_size, num_gpu_blocks, ...)."""
    m = CACHE_INFO.search(metrics_text)
    if not m:
        return {}
    return dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels")))


def engine_shape(engine_kw: dict[str, Any], cache: dict[str, str]) -> dict[str, Any]:
    """The real engine's scheduling shape, for the simulated one: the config's engine arguments,
    else what the real engine reported, else vLLM's CPU defaults."""
    block = int(engine_kw.get("block_size") or cache.get("block_size") or CPU_DEFAULTS["block_size"])
    blocks = cache.get("num_gpu_blocks") or cache.get("num_cpu_blocks")
    kv_tokens = 262_144 if not blocks or blocks == "None" else int(blocks) * block
    return {"max_num_seqs": int(engine_kw.get("max_num_seqs") or 128),
            "max_num_batched_tokens": int(engine_kw.get("max_num_batched_tokens")
                                          or CPU_DEFAULTS["max_num_batched_tokens"]),
            "block_size": block, "num_blocks": max(1, kv_tokens // block),
            "prefix_caching": engine_kw.get("enable_prefix_caching") is not False}


def http_text(url: str, timeout_s: float = 10.0) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (loopback only)
        return str(resp.read().decode())


def real_side(ns: argparse.Namespace, args: dict[str, Any], cells: list[Cell], r: procs.Run,
              log: Path) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    flags = procs.direct_server_flags(args["engine_kwargs"], args["frontend"])
    port = harness.free_port()
    proc = procs.start_direct(flags, port, args["env"], r.base.with_name(f"{r.base.name}.real-vllm.log"))
    try:
        url = f"http://127.0.0.1:{port}"
        t = harness.wait_until(lambda: harness.http_status(f"{url}/health") == 200, [proc],
                               "direct vLLM", ns.startup_timeout, say)
        say(f"real engine (direct vLLM) ready in {t:.0f} s")
        try:
            cache = cache_config(http_text(f"{url}/metrics"))
        except OSError:
            cache = {}
        shape = engine_shape(args["engine_kwargs"], cache)
        say(f"real engine's shape: {shape} (vllm:cache_config_info {cache or 'not found'})")
        return measure(ns, "real", url, ns.model, args["model_path"], cells, log, r.stamp), shape
    finally:
        harness.stop(proc, timeout_s=30, say=say)


def sim_side(ns: argparse.Namespace, config: Path, model_path: str, shape: dict[str, Any],
             cells: list[Cell], r: procs.Run, log: Path) -> dict[str, list[dict[str, Any]]]:
    port = harness.free_port()
    # At direct vLLM's niceness (procs.start_direct), so the load client is served first on both.
    argv = ["nice", "-n", str(procs.RAY_WORKER_NICENESS), *harness.CLI, "sim-engine", "--config",
            str(config), "--model", ns.model,
            "--profile", ns.profile, "--num-blocks", str(shape["num_blocks"]),
            "--block-size", str(shape["block_size"]),
            "--max-num-batched-tokens", str(shape["max_num_batched_tokens"]),
            "--host", "127.0.0.1", "--port", str(port)]
    say(f"starting the simulated engine: {' '.join(argv[4:])}")
    proc = harness.spawn("simulated engine", argv, r.base.with_name(f"{r.base.name}.sim-engine.log"))
    try:
        url = f"http://127.0.0.1:{port}"
        t = harness.wait_until(lambda: harness.http_status(f"{url}/health") == 200, [proc],
                               "simulated engine", ns.startup_timeout, say)
        say(f"simulated engine ready in {t:.0f} s")
        return measure(ns, "sim", url, ns.model, model_path, cells, log, r.stamp)
    finally:
        harness.stop(proc, timeout_s=15, say=say)


# ---- the comparison -----------------------------------------------------------------------------------
def compare(real: dict[str, dict[str, float]], sim: dict[str, dict[str, float]],
            tolerance: float) -> list[dict[str, Any]]:
    """A row per cell and figure: real, sim, sim / real, and whether it is within ±tolerance."""
    rows = []
    for cell, figs in real.items():
        if cell not in sim:
            continue
        for f in FIGURES:
            a, b = float(figs[f]), float(sim[cell][f])
            ratio = b / a if a > 0 else math.inf
            rows.append({"cell": cell, "figure": f, "real": a, "sim": b, "ratio": ratio,
                         "within": abs(ratio - 1) <= tolerance + 1e-9})
    return rows


def _num(f: str, v: float) -> str:
    return f"{v:,.0f}" if f == "output_tok_s" else f"{v:,.1f}" if v >= 10 else f"{v:.2f}"


def markdown_table(rows: list[dict[str, Any]], tolerance: float) -> str:
    """Real vs simulated per cell: each figure's real value, simulated value and ratio, a ⚠ on a
    ratio outside ±tolerance."""
    by_cell: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_cell.setdefault(r["cell"], {})[r["figure"]] = r
    head = "| cell | " + " | ".join(f"{FIGURE_NAMES[f]} real / SIM (ratio)" for f in FIGURES) + " |"
    lines = [head, "|---|" + "---:|" * len(FIGURES)]
    for cell, figs in by_cell.items():
        cols = []
        for f in FIGURES:
            row = figs.get(f)
            if row is None:
                cols.append("")
                continue
            mark = "" if row["within"] else " ⚠"
            cols.append(f"{_num(f, row['real'])} / {_num(f, row['sim'])} ({row['ratio']:.2f}x{mark})")
        lines.append(f"| {cell} | " + " | ".join(cols) + " |")
    misses = [r for r in rows if not r["within"]]
    lines += ["", f"{len(rows) - len(misses)} of {len(rows)} figures within ±{tolerance:.0%}"
              + ("." if not misses else ": outside are " + ", ".join(
                  f"{r['cell']} {FIGURE_NAMES[r['figure']]} ({r['ratio']:.2f}x)" for r in misses) + ".")]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], out: Path, title: str, tolerance: float) -> Path:
    """One panel per figure: real and simulated bars per cell, the ratio written above."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(dict.fromkeys(r["cell"] for r in rows))
    fig, axes = plt.subplots(1, len(FIGURES), figsize=(15, 4.2))
    for ax, f in zip(axes, FIGURES, strict=True):
        figs = {r["cell"]: r for r in rows if r["figure"] == f}
        xs = range(len(cells))
        ax.bar([x - 0.2 for x in xs], [figs[c]["real"] for c in cells], 0.4, label="real CPU engine")
        ax.bar([x + 0.2 for x in xs], [figs[c]["sim"] for c in cells], 0.4, label="SIMULATED (cpu-tiny)")
        for x, c in zip(xs, cells, strict=True):
            r = figs[c]
            ax.annotate(f"{r['ratio']:.2f}x", (x, max(r["real"], r["sim"])), ha="center", va="bottom",
                        fontsize=8, color="black" if r["within"] else "red")
        ax.set_xticks(list(xs), cells, fontsize=8)
        ax.set_title(FIGURE_NAMES[f] + f" (red: outside ±{tolerance:.0%})", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---- main ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    r = procs.new_run("sim-validate", "loadtests.bench.sim_validate", ns.config, ns.results_dir, argv)
    cells = cells_of(ns)
    log = r.base.with_suffix(".log")
    t_start = time.monotonic()
    args = run.engine_args(r.config, ns.model)
    say(f"cells: {', '.join(c.name for c in cells)}; {ns.repeats} repeat(s); vLLM output in {log}")
    earlier: dict[str, Any] | None = json.loads(Path(ns.real_from).read_text()) if ns.real_from else None
    shape: dict[str, Any]
    if earlier is not None:
        real_runs = {c.name: earlier["real_runs"][c.name] for c in cells}
        shape = earlier["engine"]
        say(f"real cells taken from {ns.real_from} (not measured in this run)")
    else:
        real_runs, shape = real_side(ns, args, cells, r, log)
    real = medians(real_runs)
    sim_runs = {} if ns.real_only else sim_side(ns, r.config, args["model_path"], shape, cells, r, log)
    sim = medians(sim_runs)
    rows = compare(real, sim, ns.tolerance)
    doc: dict[str, Any] = {
        "command": r.command, "timestamp": r.stamp, "model": ns.model, "config": str(r.config),
        "profile": ns.profile, "engine": shape, "cells": [asdict(c) for c in cells],
        "repeats": ns.repeats, "seed": ns.seed, "tolerance": ns.tolerance,
        "real_from": ns.real_from, "host": {"cpus": os.cpu_count()},
        "real": real, "sim": sim, "real_runs": real_runs, "sim_runs": sim_runs, "rows": rows,
        "all_within": bool(rows) and all(x["within"] for x in rows),
        "wall_time_s": round(time.monotonic() - t_start, 1),
    }
    title = (f"{ns.model}: real CPU engine (direct vLLM) vs SIMULATED ({ns.profile}), "
             f"medians of {ns.repeats}")
    lines = [f"# Simulated engine vs real: {ns.model} ({r.stamp})", "",
             f"`{r.command}`", "",
             f"Real: plain vLLM's OpenAI server with `serve-app engine-args --config {ns.config} "
             f"--model {ns.model}` (a real CPU engine){' — taken from ' + ns.real_from if ns.real_from else ''}. "
             f"SIMULATED: `serve-app sim-engine` with profile `{ns.profile}` and the same engine "
             f"arguments, shape {shape}. One live engine at a time; streamed completions of token-id "
             f"prompts, {ns.output_len} output tokens, --ignore-eos; medians of {ns.repeats}.", "",
             "Cells: " + "; ".join(
                 f"{c.name} = c{c.concurrency}, {c.num_prompts} prompts of "
                 + (f"{c.prefix_len} shared + {c.input_len} own" if c.prefix_len else f"{c.input_len}")
                 + " tokens" for c in cells) + ".", ""]
    if rows:
        lines.append(markdown_table(rows, ns.tolerance))
        try:
            png = plot(rows, r.base.with_suffix(".png"), title, ns.tolerance)
            lines.append(f"![real vs simulated]({png.name})\n")
        except Exception as exc:  # the chart is a convenience; the table is the result
            say(f"WARNING: no chart: {type(exc).__name__}: {exc}")
    else:
        lines += ["| cell | " + " | ".join(FIGURE_NAMES[f] for f in FIGURES) + " |",
                  "|---|" + "---:|" * len(FIGURES)]
        lines += [f"| {c} | " + " | ".join(_num(f, v[f]) for f in FIGURES) + " |" for c, v in real.items()]
    procs.write_results(r.base, doc, "\n".join(lines) + "\n")
    failed = sum(int(v["failed"]) for v in (*real.values(), *sim.values()))
    if failed:
        say(f"FAIL: {failed} request(s) failed")
        return 1
    return 0 if ns.real_only or doc["all_within"] else 3


if __name__ == "__main__":
    sys.exit(main())
