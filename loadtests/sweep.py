"""Sweep one engine setting: redeploy, warm up, run the same locust load, and compare.

    python -m loadtests.sweep --config configs/local.yaml --model tiny-chat --param max_num_seqs=4,8,16,32

For each value it starts the app (``serve-app run``, through loadtests.harness.stack) with a copy of the
config in which the model's setting has that value, on a free loopback port, with one key per tier
(``serve-app keys create``); warms it up; runs a
headless locust load (loadtests/locustfile.py) with the same users, spawn rate, duration and mix;
samples the model replica's memory (RSS of the ``ServeReplica:...:model-<id>`` process and its
engine subprocesses) while the load runs; and stops the app's whole process tree. It writes
``sweep.csv``, ``sweep.md`` and ``sweep.png`` (output tokens/s against TTFT p95, one point per
value and tier, each tier's TTFT objective as a horizontal line) into the results directory, and
recommends the value with the highest throughput whose top tier (premium) still meets its SLA.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from loadtests.harness import stack as harness
from loadtests.harness.stack import Stack
from loadtests.sla import Objective, read_objectives, top_tier
from serve_app.config import APP_NAME

ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = ROOT / "loadtests" / "locustfile.py"


def say(msg: str) -> None:
    print(f"[sweep] {msg}", flush=True)


def parse_param(text: str) -> tuple[str, list[Any]]:
    """``max_num_seqs=4,8`` -> ("max_num_seqs", [4, 8]); values are read as YAML scalars."""
    name, sep, values = text.partition("=")
    if not sep or not name or not values:
        raise argparse.ArgumentTypeError(f"--param ({text!r}) must look like name=v1,v2,...")
    return name.strip(), [yaml.safe_load(v) for v in values.split(",") if v.strip()]


def apply_value(model_id: str, param: str, value: Any, only_model: bool) -> harness.EditArgs:
    """An edit of the app's args that gives ``param`` the ``value`` for one model."""
    from serve_app.config import EngineArgs

    def edit(args: dict[str, Any]) -> None:
        models = args["models"]
        model = next((m for m in models if m["id"] == model_id), None)
        if model is None:
            raise SystemExit(f"--model ({model_id!r}) is not a model id in the config")
        if only_model:  # one engine per machine core is plenty; the others only cost start-up time
            keep = {model_id, model.get("fallback")}
            args["models"] = [m for m in models if m["id"] in keep]
            args["routes"] = [r for r in args.get("routes", [])
                              if all(t["model"] in keep for t in r["split"])]
        seqs_before = (model.get("engine") or {}).get("max_num_seqs")
        if "." in param:  # e.g. deployment.max_ongoing_requests
            *path, leaf = param.split(".")
            node = model
            for part in path:
                node = node.setdefault(part, {})
            node[leaf] = value
        elif param in EngineArgs.model_fields and param != "extra":
            model.setdefault("engine", {})[param] = value
        else:
            model.setdefault("engine", {}).setdefault("extra", {})[param] = value
        _keep_reserve_share(model, seqs_before)

    return edit


def _keep_reserve_share(model: dict[str, Any], seqs_before: int | None) -> None:
    """Scale the top tier's reserved slots with max_num_seqs, so each value keeps the same share."""
    admission = model.get("admission") or {}
    reserved = admission.get("reserved_slots") or 0
    seqs = (model.get("engine") or {}).get("max_num_seqs")
    if not reserved or not seqs_before or not seqs or seqs == seqs_before:
        return
    scaled = min(seqs - 1, max(1, round(reserved * seqs / seqs_before)))
    if scaled != reserved:
        say(f"  admission.reserved_slots {reserved} -> {scaled} (same share of max_num_seqs={seqs})")
        model["admission"] = {**admission, "reserved_slots": scaled}


class MemorySampler(threading.Thread):
    """Peak RSS of the model replica's process tree, found among the app process's descendants."""

    def __init__(self, root_pid: int, deployment: str, interval_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.root_pid = root_pid
        self.marker = f"ServeReplica:{APP_NAME}:{deployment}"
        self.interval_s = interval_s
        self.peak = 0
        self.stop_event = threading.Event()

    def sample(self) -> int:
        try:
            procs = psutil.Process(self.root_pid).children(recursive=True)
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            try:
                if self.marker not in " ".join(p.cmdline()):
                    continue
                tree = [p, *p.children(recursive=True)]
                total += sum(q.memory_info().rss for q in tree if q.is_running())
            except psutil.Error:
                continue
        return total

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.peak = max(self.peak, self.sample())
            self.stop_event.wait(self.interval_s)


def warm_up(stack: Stack, model: str, key: str, requests: int) -> None:
    """A few short streamed requests, so that the first measured ones do not pay for cold paths."""
    with httpx.Client(base_url=stack.root_url, timeout=60) as client:
        for _ in range(requests):
            with client.stream("POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                               json={"model": model, "max_tokens": 16, "stream": True,
                                     "messages": [{"role": "user", "content": "warm up"}]}) as r:
                r.raise_for_status()
                for _ in r.iter_lines():
                    pass


@dataclass
class Row:
    value: Any
    result: dict[str, Any] = field(default_factory=dict)
    peak_rss_bytes: int = 0
    exit_code: int | None = None
    error: str = ""

    def tier(self, name: str) -> dict[str, Any]:
        return next((t for t in self.result.get("tiers", []) if t["tier"] == name), {})


def key_id(tier: str) -> str:
    return f"sweep-{tier}"


def run_load(ns: argparse.Namespace, stack: Stack, tiers: Iterable[str],
             workdir: Path) -> tuple[int, dict[str, Any]]:
    sla_json = workdir / "sla.json"
    env = {**os.environ, **{f"SERVE_APP_KEY_{t.upper()}": stack.keys[key_id(t)] for t in tiers}}
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", stack.root_url,
           "--headless", "-u", str(ns.users), "-r", str(ns.spawn_rate), "-t", ns.duration,
           "--only-summary", "--app-config", str(stack.config), "--model", ns.model, "--mix", ns.mix,
           "--max-output-tokens", str(ns.max_output_tokens), "--sla-json", str(sla_json),
           "--csv", str(workdir / "locust")]
    if ns.prompts:
        cmd += ["--prompts", ns.prompts]
    with open(workdir / "locust.log", "w") as out:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=ns.load_timeout_s)
    for line in (workdir / "locust.log").read_text().splitlines():
        if line.startswith("SLA "):
            say(f"  {line}")
    result = json.loads(sla_json.read_text()) if sla_json.exists() else {}
    return proc.returncode, result


def _ms(v: Any) -> str:
    return "" if v is None else f"{v:.0f}"


def table_rows(param: str, rows: list[Row], tiers: list[str]) -> tuple[list[str], list[list[str]]]:
    head = [param, "output tok/s", "TTFT p50 ms", "TTFT p95 ms", "TPOT p95 ms", "requests", "errors",
            "replica peak RSS MiB"]
    head += [f"{t} SLA" for t in tiers]
    out = []
    for r in rows:
        agg = r.result.get("all", {})
        reqs = sum(t.get("requests", 0) for t in r.result.get("tiers", []))
        errs = sum(t.get("errors", 0) for t in r.result.get("tiers", []))
        line = [str(r.value), f"{r.result.get('output_tokens_per_s', 0):.0f}" if r.result else "",
                _ms(agg.get("ttft_p50_ms")), _ms(agg.get("ttft_p95_ms")), _ms(agg.get("tpot_p95_ms")),
                str(reqs), str(errs), f"{r.peak_rss_bytes / 2**20:.0f}" if r.peak_rss_bytes else ""]
        for t in tiers:
            tr = r.tier(t)
            if not tr:
                line.append("not run")
            elif tr["ttft_p95_ms"] is None or tr["tpot_p95_ms"] is None:
                line.append(tr["status"])
            else:
                line.append(f"{tr['status']} ({_ms(tr['ttft_p95_ms'])}/{_ms(tr['tpot_p95_ms'])} ms)")
        out.append(line)
    return head, out


def recommend(rows: list[Row], top: str) -> Row | None:
    ok = [r for r in rows if r.tier(top).get("status") == "PASS"]
    return max(ok, key=lambda r: r.result.get("output_tokens_per_s", 0)) if ok else None


def write_outputs(ns: argparse.Namespace, param: str, rows: list[Row], objectives: dict[str, Objective],
                  top: str, out_dir: Path) -> str:
    tiers = list(objectives)
    head, body = table_rows(param, rows, tiers)
    with open(out_dir / "sweep.csv", "w", newline="") as f:
        w = csv.writer(f)
        cols = [param, "output_tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "tpot_p95_ms", "requests",
                "errors", "peak_replica_rss_bytes"]
        for t in tiers:
            cols += [f"{t}_ttft_p95_ms", f"{t}_tpot_p95_ms", f"{t}_sla"]
        w.writerow(cols + ["error"])
        for r in rows:
            agg = r.result.get("all", {})
            line = [r.value, r.result.get("output_tokens_per_s"), agg.get("ttft_p50_ms"),
                    agg.get("ttft_p95_ms"), agg.get("tpot_p95_ms"),
                    sum(t.get("requests", 0) for t in r.result.get("tiers", [])),
                    sum(t.get("errors", 0) for t in r.result.get("tiers", [])), r.peak_rss_bytes]
            for t in tiers:
                tr = r.tier(t)
                line += [tr.get("ttft_p95_ms"), tr.get("tpot_p95_ms"), tr.get("status", "")]
            w.writerow(line + [r.error])
    best = recommend(rows, top)
    rec = (f"Recommendation: {param}={best.value} (highest output throughput, "
           f"{best.result['output_tokens_per_s']:.0f} tok/s, whose top tier {top} meets its SLA)"
           if best else f"Recommendation: no value meets the SLA of the top tier, {top}")
    md = [f"# Sweep of {param} for {ns.model}", "",
          f"Load per value: {ns.users} users (spawn rate {ns.spawn_rate}/s) for {ns.duration}, mix "
          f"`{ns.mix}`, max_tokens capped at {ns.max_output_tokens}; config `{ns.config}`. "
          "TTFT/TPOT columns are over all tiers; a tier's cell is its verdict (TTFT p95/TPOT p95).", "",
          "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(line) + " |" for line in body]
    md += ["", "Objectives (p95): " + ", ".join(
        f"{t} TTFT {o.ttft_p95_ms:.0f} ms / TPOT {o.tpot_p95_ms:.0f} ms" for t, o in objectives.items()),
        "", rec, ""]
    (out_dir / "sweep.md").write_text("\n".join(md))
    plot(param, rows, objectives, out_dir / "sweep.png", ns.model)
    return rec


def plot(param: str, rows: list[Row], objectives: dict[str, Objective], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=90)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (tier, obj) in enumerate(objectives.items()):
        color = colors[i % len(colors)]
        marker = "os^Dv"[i % 5]
        pts = [(r.result["output_tokens_per_s"], r.tier(tier)["ttft_p95_ms"], r.value)
               for r in rows if r.tier(tier).get("ttft_p95_ms") is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, linestyle="-", color=color,
                    label=f"{tier} TTFT p95", alpha=0.85)
            for x, y, v in pts:
                ax.annotate(f"{v}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.axhline(obj.ttft_p95_ms, color=color, linestyle="--", linewidth=1,
                   label=f"{tier} objective {obj.ttft_p95_ms:.0f} ms")
    ax.set_yscale("log")
    ax.set_xlabel("output tokens/s (all tiers)")
    ax.set_ylabel("TTFT p95 (ms, log scale)")
    ax.set_title(f"{model}: sweep of {param} (labels are the values)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/local.yaml", help="the Ray Serve config to start from")
    p.add_argument("--model", default="tiny-chat")
    p.add_argument("--param", required=True, type=parse_param,
                   help="engine setting and values, e.g. max_num_seqs=4,8,16 (or deployment.<field>=...)")
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--spawn-rate", type=float, default=8)
    p.add_argument("--duration", default="60s", help="locust -t for each value")
    p.add_argument("--mix", default="premium=1,standard=2,batch=1")
    p.add_argument("--max-output-tokens", type=int, default=256)
    p.add_argument("--prompts", default="", help="prompts JSONL or ShareGPT JSON (default: bundled)")
    p.add_argument("--warmup-requests", type=int, default=4)
    p.add_argument("--results-dir", type=Path, default=None,
                   help="default: results/sweep/sweep-<param>-<UTC time> (ignored by git)")
    p.add_argument("--start-timeout-s", type=float, default=900)
    p.add_argument("--start-retries", type=int, default=1,
                   help="start the app again this many times if it exits during start-up")
    p.add_argument("--load-timeout-s", type=float, default=900)
    p.add_argument("--keep-other-models", action="store_true",
                   help="start every model of the config, not only --model (and its fallback)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    param, values = ns.param
    config = Path(ns.config).resolve()
    objectives = read_objectives(config)
    top = top_tier(objectives)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out_dir = (ns.results_dir or ROOT / "results" / "sweep" / f"sweep-{param}-{stamp}").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    deployment = harness.read_config(config).model(ns.model).deployment_name
    say(f"{param} in {values} for {ns.model}; {ns.users} users for {ns.duration} each; "
        f"results in {out_dir}")
    rows: list[Row] = []
    t_all = time.monotonic()
    for i, value in enumerate(values, 1):
        row = Row(value=value)
        rows.append(row)
        workdir = out_dir / f"{param}-{value}"
        workdir.mkdir(parents=True, exist_ok=True)
        say(f"[{i}/{len(values)}] {param}={value}: starting the app ...")
        stack = None
        try:
            stack = harness.start_stack(
                config, workdir, keys={key_id(t): (t, ["*"]) for t in objectives},
                edit=apply_value(ns.model, param, value, not ns.keep_other_models),
                timeout_s=ns.start_timeout_s, retries=ns.start_retries, say=say)
        except harness.ConfigRefused as exc:  # a value the schema refuses stops the sweep
            raise SystemExit(f"{param}={value} makes an invalid config:\n{exc}") from None
        except RuntimeError as exc:
            # Ray's own start-up can time out on a busy machine; start_stack has retried.
            row.error = str(exc)[:2000]
            say(f"  {exc}")
        if stack is None:
            continue
        sampler = MemorySampler(stack.proc.pid, deployment)
        try:
            say(f"  warming up ({ns.warmup_requests} requests) ...")
            warm_up(stack, ns.model, stack.keys[key_id(top)], ns.warmup_requests)
            sampler.start()
            say(f"  load: {ns.users} users for {ns.duration} ...")
            row.exit_code, row.result = run_load(ns, stack, objectives, workdir)
        except Exception as exc:  # keep sweeping: one bad value must not lose the others
            row.error = f"{exc.__class__.__name__}: {exc}"[:300]
            say(f"  failed: {row.error}")
        finally:
            sampler.stop_event.set()
            if sampler.is_alive():
                sampler.join(timeout=5)
            row.peak_rss_bytes = sampler.peak
            stack.stop(say)
        if row.result:
            say(f"  {row.result['output_tokens_per_s']:.0f} output tok/s, TTFT p95 "
                f"{_ms(row.result['all'].get('ttft_p95_ms'))} ms, replica peak RSS "
                f"{row.peak_rss_bytes / 2**20:.0f} MiB")
        write_outputs(ns, param, rows, objectives, top, out_dir)
    rec = write_outputs(ns, param, rows, objectives, top, out_dir)
    say(f"done in {time.monotonic() - t_all:.0f} s")
    print((out_dir / "sweep.md").read_text(), flush=True)
    say(f"wrote {out_dir / 'sweep.csv'}, {out_dir / 'sweep.md'}, {out_dir / 'sweep.png'}")
    say(rec)
    return 0 if all(r.result for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
