"""Streaming through the gateway against direct vLLM, measured by vLLM's own benchmark.

``python -m loadtests.bench`` starts vLLM's OpenAI server with the app's engine arguments for one
model, and the full stack (``serve-app run``: Ray Serve, gateway, keys) unless ``--gateway-url`` and
``--api-key`` name a running one. It then runs ``vllm.benchmarks.serve`` (the code behind
``vllm bench serve``) against both with the same seed, prompts and fixed output lengths, at each
concurrency and for each repeat, and reports medians, the gateway/direct ratios, each side's
front-end CPU per 1,000 output tokens and the gateway replica's peak RSS. It fails (exit 1) if a
request failed or an output token count differs.

The runs are fair: only the side under test has a live vLLM engine. The other sides' engine
processes are suspended (SIGSTOP) during its run and resumed before their own (``procs.EngineSwitch``;
docs/PERFORMANCE.md, "Fairness"), the order alternates, and every figure is a median of the repeats.

The direct side gets the engine arguments from ``serve-app engine-args``, the stack comes from
loadtests.harness.stack and its key from ``serve-app keys create``: the benchmark uses only public commands.

Results: ``results/bench/bench-<timestamp>.json`` and ``.md`` (``--results-dir``); vLLM's own
console output goes to ``results/bench/bench-<timestamp>.log``. All traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from loadtests.bench import peers as peers
from loadtests.bench import procs as procs
from loadtests.bench import report as report
from loadtests.bench.procs import say
from loadtests.harness import stack as harness
from loadtests.harness.stack import ROOT, Proc, Stack

ENDPOINTS = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions"}
FULL = {"concurrency": "1,16,64", "input_len": 128, "output_len": 64, "repeats": 3}
SMOKE = {"concurrency": "1,4", "input_len": 32, "output_len": 16, "repeats": 1, "num_prompts": 8}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/local.yaml", help="Ray Serve config file of the app")
    p.add_argument("--model", default="tiny-chat", help="model id in the config")
    p.add_argument("--concurrency", help=f"comma-separated (default {FULL['concurrency']}; "
                                         f"--smoke: {SMOKE['concurrency']})")
    p.add_argument("--num-prompts", type=int,
                   help="requests per run (default: max(32, 8 x concurrency); --smoke: 8)")
    p.add_argument("--input-len", type=int, help=f"prompt tokens (default {FULL['input_len']})")
    p.add_argument("--output-len", type=int, help=f"output tokens (default {FULL['output_len']})")
    p.add_argument("--repeats", type=int, help=f"runs per side and concurrency; medians are "
                                               f"reported (default {FULL['repeats']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=sorted(ENDPOINTS), default="openai-chat",
                   help="vLLM bench backend: streaming chat or text completions")
    p.add_argument("--gateway-url", help="use this running stack (e.g. http://127.0.0.1:8000/v1)")
    p.add_argument("--api-key", help="key for --gateway-url")
    p.add_argument("--ray-address", help="GCS address of the stack's Ray cluster, for the RSS "
                                         "(default: found from the process listening on the gateway port)")
    p.add_argument("--results-dir", default=str(ROOT / "results" / "bench"),
                   help="where the result files go (default: results/bench/, ignored by git)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds per benchmark run")
    p.add_argument("--smoke", action="store_true",
                   help="quick check: concurrency 1 and 4, 8 prompts of 16 tokens, 1 repeat")
    p.add_argument("--no-suspend", action="store_true",
                   help="keep every side's vLLM engine live during every run (the method before the "
                        "fair benchmark; only to compare with it): by default the other sides' engine "
                        "processes are suspended (SIGSTOP) during each side's run")
    p.add_argument("--peer-venvs", help="folder of the peers' venvs (default: <results-dir>/peers/venvs)")
    p.add_argument("--peers", nargs="?", const=",".join(report.PEER_SIDES), default="",
                   help="also run the same load against the peers (default with the flag: "
                        f"{','.join(report.PEER_SIDES)}): Ray Serve LLM and the LiteLLM proxy in "
                        "front of direct vLLM, each from its own venv under the results folder "
                        "(loadtests.bench.peers); adds a chart (.png)")
    ns = p.parse_args(argv)
    defaults = SMOKE if ns.smoke else FULL
    for k, v in defaults.items():
        if getattr(ns, k, None) is None:
            setattr(ns, k, v)
    if bool(ns.gateway_url) != bool(ns.api_key):
        p.error("--gateway-url and --api-key go together")
    ns.peer_sides = tuple(x.strip() for x in str(ns.peers).split(",") if x.strip())
    unknown = set(ns.peer_sides) - set(report.PEER_SIDES)
    if unknown:
        p.error(f"--peers: unknown peer(s) {sorted(unknown)}; known: {','.join(report.PEER_SIDES)}")
    ns.sides = (*report.SIDES, *ns.peer_sides)
    ns.concurrencies = [int(c) for c in str(ns.concurrency).split(",") if c.strip()]
    if not ns.concurrencies or min(ns.concurrencies) < 1 or ns.repeats < 1:
        p.error("--concurrency needs positive integers and --repeats at least 1")
    return ns


def prompts_for(ns: argparse.Namespace, c: int) -> int:
    return ns.num_prompts or max(32, 8 * c)


# ---- one benchmark run ------------------------------------------------------------------------------
def roots_of(root: int | list[int] | None) -> list[int]:
    """A side's process-tree roots (a proxy's list includes the server behind it)."""
    return [] if root is None else [root] if isinstance(root, int) else list(root)


def run_one(ns: argparse.Namespace, side: str, root_url: str, key: str | None, model_id: str,
            model_path: str, c: int, repeat: int, log: Path, stamp: str,
            root: int | list[int] | None, switch: procs.EngineSwitch | None = None,
            others: list[int] | None = None) -> dict[str, Any]:
    """One ``vllm.benchmarks.serve`` run, in this process; its console output goes to ``log``.
    With ``root`` (a server's process), the CPU seconds each process of its tree used during the
    run are recorded; with ``others`` (the other sides' roots), the CPU those used meanwhile
    (``background_cpu_s``). With ``switch``, only this side's engines are live during the run."""
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    n = prompts_for(ns, c)
    roots = roots_of(root)
    engines = switch.only(side) if switch is not None else None
    argv = [
        "--backend", ns.backend, "--base-url", root_url, "--endpoint", ENDPOINTS[ns.backend],
        "--model", model_id, "--tokenizer", model_path,
        "--dataset-name", "random", "--random-input-len", str(ns.input_len),
        "--random-output-len", str(ns.output_len), "--num-prompts", str(n), "--seed", str(ns.seed),
        "--max-concurrency", str(c), "--ignore-eos", "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--num-warmups", str(min(c, 8)), "--disable-tqdm", "--save-detailed",
        "--request-id-prefix", f"bench-{stamp}-{side}-r{repeat}-c{c}-",
        "--label", f"{side}-c{c}-r{repeat}",
    ]
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    # vLLM's request functions send `Authorization: Bearer $OPENAI_API_KEY` (lib/endpoint_request_func.py).
    saved = os.environ.pop("OPENAI_API_KEY", None)
    if key:
        os.environ["OPENAI_API_KEY"] = key
    t0 = time.monotonic()
    cpu0, client0 = procs.cpu_seconds_of(roots), time.process_time()
    bg0 = procs.cpu_seconds_of(others or [])
    try:
        with open(log, "a") as out, contextlib.redirect_stdout(out):
            print(f"\n===== {side} concurrency={c} repeat={repeat} prompts={n} =====", flush=True)
            result = asyncio.run(asyncio.wait_for(main_async(args), ns.run_timeout))
        metrics = report.run_metrics(result)
        texts = list(result.get("generated_texts") or [])
    except TimeoutError:
        metrics, texts = report.failed_run(f"run timed out after {ns.run_timeout:.0f} s"), []
    except Exception as exc:  # a run that raises counts as all requests failed
        metrics, texts = report.failed_run(f"{type(exc).__name__}: {exc}"), []
    finally:
        os.environ.pop("OPENAI_API_KEY", None)
        if saved is not None:
            os.environ["OPENAI_API_KEY"] = saved
    cpu = report.cpu_delta(cpu0, procs.cpu_seconds_of(roots))
    cpu[report.CLIENT] = round(time.process_time() - client0, 2)
    metrics["cpu_s"] = dict(sorted(cpu.items(), key=lambda kv: -kv[1]))
    if others:
        metrics["background_cpu_s"] = round(sum(report.cpu_delta(
            bg0, procs.cpu_seconds_of(others), floor=0.0).values()), 2)
    if engines is not None:
        metrics["engines"] = engines
    say(f"  {side:8} c={c:<3} repeat {repeat}: {metrics['output_tok_s']:7.0f} tok/s  "
        f"{metrics['req_s']:6.2f} req/s  TTFT p50 {metrics['ttft_p50_ms']:7.1f} ms  "
        f"TPOT p50 {metrics['tpot_p50_ms']:6.2f} ms  {metrics['completed']}/{n} ok, "
        f"{metrics['total_output_tokens']} tokens  ({time.monotonic() - t0:.0f} s)")
    if roots:
        say("          CPU s: " + ", ".join(f"{k} {v:.1f}" for k, v in list(metrics["cpu_s"].items())[:6])
            + (f"; other sides {metrics['background_cpu_s']:.1f}" if others else ""))
    if engines is not None:
        say(f"          engines: {engines['live']} process(es) live, suspended "
            f"{engines['suspended'] or 'none'}")
    for e in metrics["errors"]:
        say(f"    error: {e}")
    return {"metrics": metrics, "texts": texts, "num_prompts": n}


# ---- the gateway replica's RSS ------------------------------------------------------------------------
def gateway_rss(ray_address: str | None, workdir: Path) -> int | None:
    """The gateway replica's peak RSS, asked through Ray in a separate process (with a timeout)."""
    if ray_address is None:
        say("WARNING: cannot tell which Ray cluster serves the gateway; gateway RSS not measured "
            "(pass --ray-address)")
        return None
    log = workdir / "rss.log"
    # Clusters started by ray.init() use token auth; an explicit address does not enable it.
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
    proc = harness.spawn("gateway RSS query",
                         [sys.executable, "-m", "loadtests.bench.rss", ray_address], log, env=env)
    try:
        proc.popen.wait(timeout=90)
    except subprocess.TimeoutExpired:
        harness.stop(proc, first=signal.SIGKILL, timeout_s=5, say=say)
    out = proc.log_tail(100_000)
    lines = [ln for ln in out.splitlines() if ln.startswith("{") and "peak_rss_bytes" in ln]
    if proc.popen.returncode != 0 or not lines:
        tail = out.strip().splitlines()[-1:] or ["no output"]
        say(f"WARNING: gateway RSS not measured via {ray_address} (exit {proc.popen.returncode}: "
            f"{tail[0][:200]})")
        return None
    return int(json.loads(lines[-1])["peak_rss_bytes"])


# ---- setup ------------------------------------------------------------------------------------------
BENCH_TIER = "bench-unlimited"


def load_model(config: Path, model_id: str) -> tuple[Any, Any]:
    cfg = harness.read_config(config)
    try:
        return cfg, cfg.model(model_id)
    except KeyError:
        raise SystemExit(f"{config}: no model {model_id!r} (have {[m.id for m in cfg.models]})") from None


def engine_args(config: Path, model_id: str) -> dict[str, Any]:
    """``serve-app engine-args``: the model's path (built if it is the builtin tiny model), its
    vLLM engine and front-end arguments and its environment, as the app would use them."""
    done = subprocess.run([*harness.CLI, "engine-args", "--config", str(config), "--model", model_id],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"serve-app engine-args failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return dict(json.loads(done.stdout))


def stack_edit(top_priority: int) -> harness.EditArgs:
    """The benchmark's one edit of the stack's config (otherwise as shipped): its unlimited tier."""
    return unlimited_tier(top_priority)


def replica_rss(root: int | None) -> dict[str, int]:
    """Peak RSS (VmHWM) of each Ray Serve replica process under ``root``: name -> bytes."""
    out: dict[str, int] = {}
    for pid in harness.descendants(root) if root else {}:
        name = " ".join(harness.cmdline(pid)).strip()
        if not name.startswith("ray::ServeReplica:"):
            continue
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                label = name.removeprefix("ray::ServeReplica:").split()[0]
                out[label] = max(out.get(label, 0), int(line.split()[1]) * 1024)
    return out


def unlimited_tier(top_priority: int) -> harness.EditArgs:
    """An edit of the stack's config: one more tier, without limits, for the benchmark's key.

    The benchmark measures the streaming path, so its key must not be rate-limited or shed: a
    configured tier's RPM or concurrency cap would turn a throughput run into a 429 count. The
    tier has the top priority (0, the priority that direct vLLM gives every request, unless a tier
    is above it), so it may use every engine slot, the top tier's reserve included.
    """
    def edit(args: dict[str, Any]) -> None:
        tiers = args.get("tiers") or {"standard": {}}
        tiers[BENCH_TIER] = {"priority": min(0, top_priority), "description": "benchmark key: no limits"}
        args["tiers"] = tiers

    return edit


def start_servers(ns: argparse.Namespace, config: Path, cfg: Any, model: Any, workdir: Path,
                  started: list[Proc]) -> tuple[dict[str, tuple[str, str | None, Any]],
                                                str | None, str]:
    """Start direct vLLM (and the stack unless given). Returns {side: (root URL, key, root process
    for CPU accounting)}, the Ray address for the RSS and the model path."""
    args = engine_args(config, model.id)
    model_path = args["model_path"]
    flags = procs.direct_server_flags(args["engine_kwargs"], args["frontend"])
    direct_port = harness.free_port()
    direct = procs.start_direct(flags, direct_port, args["env"], workdir / "direct-vllm.log")
    started.append(direct)
    direct_url = f"http://127.0.0.1:{direct_port}"

    stack: Stack | None = None
    if ns.gateway_url:
        procs.require_loopback(ns.gateway_url)
        gw_root = ns.gateway_url.rstrip("/").removesuffix("/v1")
        key = ns.api_key
        say(f"using the running stack at {gw_root}")
    else:
        say(f"starting the stack; its key 'bench' has tier {BENCH_TIER} (no rate limits)")
        # Waits for the stack and fails fast if direct vLLM exits meanwhile.
        stack = harness.start_stack(config, workdir / "stack", keys={"bench": (BENCH_TIER, [model.id])},
                                    edit=stack_edit(cfg.top_priority),
                                    timeout_s=ns.startup_timeout,
                                    retries=1, watch=[direct], say=say)
        started.append(stack.proc)
        gw_root, key = stack.root_url, stack.keys["bench"]

    waiting = [p for p in (direct, stack.proc if stack else None) if p is not None]
    t = harness.wait_until(lambda: harness.http_status(f"{direct_url}/health") == 200, waiting,
                           "direct vLLM", ns.startup_timeout, say)
    say(f"direct vLLM ready ({t:.0f} s more)")

    for name, root, k in (("direct vLLM", direct_url, None), ("gateway", gw_root, key)):
        body = {"model": model.id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        headers = {"Authorization": f"Bearer {k}"} if k else {}
        status = harness.http_status(f"{root}/v1/chat/completions", 120, headers, body)
        if status != 200:
            raise RuntimeError(f"{name} answered {status} to a test request at {root}"
                               + (" (is the API key right?)" if status == 401 else ""))

    ray_address = ns.ray_address
    if ray_address is None:
        port = urlsplit(gw_root).port or 80
        # Our own stack names its cluster; a running one is found from the process on its port.
        ray_address = stack.ray_address() if stack else procs.ray_address_for_http_port(port)
        if ray_address:
            say(f"Ray cluster of the gateway: {ray_address}")
    gw_root_pid = stack.proc.pid if stack else procs.root_of_port(urlsplit(gw_root).port or 80)
    sides: dict[str, tuple[str, str | None, Any]] = {
        "direct": (direct_url, None, direct.pid), "gateway": (gw_root, key, gw_root_pid)}
    if ns.peer_sides:
        sides.update(start_peers(ns, model.id, args, direct, direct_url, workdir, started))
    return sides, ray_address, model_path


def _answers(url: str) -> bool:
    return harness.http_status(url) == 200


def start_peers(ns: argparse.Namespace, model_id: str, args: dict[str, Any], direct: Proc,
                direct_url: str, workdir: Path, started: list[Proc]) -> dict[str, tuple[str, None, Any]]:
    """Start the peers (each from its own venv) and wait until each answers a chat request.
    LiteLLM's CPU is accounted with the direct vLLM server behind it."""
    venvs = peers.venv_dirs(Path(ns.results_dir), Path(ns.peer_venvs) if ns.peer_venvs else None)
    out: dict[str, tuple[str, None, Any]] = {}
    waits: list[tuple[str, Proc, Callable[[], bool], str]] = []
    for side in ns.peer_sides:
        python = peers.ensure_venv(side, venvs[side], say)
        port = harness.free_port()
        url = f"http://127.0.0.1:{port}"
        if side == "rayserve":
            cfg = peers.rayserve_llm_config(model_id, args["model_path"], args["engine_kwargs"],
                                            args["env"])
            proc, ready = peers.start_rayserve(python, workdir, port, cfg, dict(os.environ))
            say(f"starting Ray Serve LLM on {url} (log {proc.log})")
            waits.append((side, proc, ready.exists, url))
            out[side] = (url, None, proc.pid)
        else:
            proc = peers.start_litellm(venvs[side], workdir, port, model_id, direct_url, dict(os.environ))
            say(f"starting the LiteLLM proxy {peers.LITELLM_VERSION} on {url} (log {proc.log})")
            waits.append((side, proc, functools.partial(_answers, f"{url}/health/liveliness"), url))
            out[side] = (url, None, [proc.pid, direct.pid])
        started.append(proc)
    for side, proc, ready_fn, url in waits:
        t = harness.wait_until(ready_fn, [proc, direct], report.SIDE_NAMES[side], ns.startup_timeout, say)
        body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        status = 0
        for _ in range(30):  # Ray Serve LLM's router may lag its status by a few seconds
            status = harness.http_status(f"{url}/v1/chat/completions", 120, {}, body)
            if status == 200:
                break
            time.sleep(2)
        if status != 200:
            raise RuntimeError(f"{report.SIDE_NAMES[side]} answered {status} to a test request at {url}")
        say(f"{report.SIDE_NAMES[side]} ready ({t:.0f} s)")
    return out


def side_order(sides: tuple[str, ...], step: int) -> list[str]:
    """The order of the sides at a step: two sides alternate (as ``make bench`` always did), more
    rotate, so that each side goes first equally often."""
    if len(sides) == 2:
        return list(sides) if step % 2 else list(reversed(sides))
    k = step % len(sides)
    return list(sides[k:] + sides[:k])


def engine_counts(m: dict[str, Any], output_len: int) -> None:
    """A peer's output tokens as the engine made them: with ``--ignore-eos`` every completed request
    has exactly ``output_len``. vLLM's benchmark reads the usage only from a chunk without choices;
    LiteLLM's usage chunk carries an empty choice, so the benchmark re-tokenizes the streamed text
    instead (about 1.2x the real count for the tiny model's gibberish), which would inflate its
    tokens/s. The count the benchmark saw is kept as ``reported_output_tokens``."""
    expected = m["completed"] * output_len
    if m["total_output_tokens"] != expected and m["duration_s"] > 0:
        m["reported_output_tokens"] = m["total_output_tokens"]
        m["total_output_tokens"] = expected
        m["output_tok_s"] = expected / m["duration_s"]


def peers_section(summary: dict[int, dict[str, Any]], ns: argparse.Namespace, base: Path,
                  meta: dict[str, Any]) -> str:
    """The side-by-side table, the CPU table at the highest concurrency, the deviations, and the
    chart (``<base>.png``)."""
    from loadtests.bench import chart as bench_chart

    top = max(ns.concurrencies)
    png = base.with_suffix(".png")
    try:
        bench_chart.plot(summary, ns.sides, png, title=f"{meta['model']} on {os.cpu_count()} cores, "
                         f"{meta['input_len']} in / {meta['output_len']} out, medians of {ns.repeats}")
        chart = f"![side by side]({png.name})\n\n"
    except Exception as exc:  # the chart is a convenience; the tables are the result
        say(f"WARNING: no chart: {type(exc).__name__}: {exc}")
        chart = ""
    return ("\n## Side by side with the peers\n\n" + report.side_by_side_markdown(summary, ns.sides)
            + "\n" + chart + f"CPU seconds per 1,000 output tokens at c{top} (median run), every "
            "process of each side's tree (LiteLLM's includes the direct vLLM behind it):\n\n"
            + report.cpu_markdown(summary, top, ns.sides)
            + "\nDeviations from the peers' defaults:\n\n" + peers.deviations_markdown(ns.peer_sides))


def command_line(argv: list[str]) -> str:
    """The command as typed, with the API key masked (it ends up in the result files)."""
    shown, hide = [], False
    for a in argv:
        shown.append("***" if hide else re.sub(r"^(--api-key=).+", r"\1***", a))
        hide = a == "--api-key"
    return " ".join(["python", "-m", "loadtests.bench", *shown])


# ---- main ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    config = Path(ns.config)
    if not config.is_absolute():
        config = (Path.cwd() / config) if (Path.cwd() / config).exists() else ROOT / config
    cfg, model = load_model(config, ns.model)
    results_dir = Path(ns.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = results_dir / f"bench-{stamp}"
    log = base.with_suffix(".log")
    workdir = Path(tempfile.mkdtemp(prefix="serve-app-bench-"))
    say(f"{'smoke' if ns.smoke else 'full'} benchmark of {model.id!r}: concurrency "
        f"{ns.concurrencies}, {ns.repeats} repeat(s), input {ns.input_len} / output "
        f"{ns.output_len} tokens, backend {ns.backend}; vLLM output in {log}")

    def _terminate(*_: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM cleans up like Ctrl-C: every started process is stopped

    signal.signal(signal.SIGTERM, _terminate)
    started: list[Proc] = []
    switch: procs.EngineSwitch | None = None
    t_start = time.monotonic()
    code = 0
    try:
        sides, ray_address, model_path = start_servers(ns, config, cfg, model, workdir, started)
        rss_before = gateway_rss(ray_address, workdir)
        roots = {side: roots_of(root) for side, (_, _, root) in sides.items()}
        if not ns.no_suspend:
            switch = procs.EngineSwitch(roots)
            say(f"fair runs: only the side under test has a live vLLM engine (the others' are "
                f"suspended with SIGSTOP; {switch.settle_s:g} s after SIGCONT before each run)")

        runs: list[dict[str, Any]] = []
        problems: list[str] = []
        warnings: list[str] = []
        peer_problems: list[str] = []
        for r in range(1, ns.repeats + 1):
            for i, c in enumerate(ns.concurrencies):
                # Rotate which side goes first, so a drift in machine load hits every side alike.
                order = side_order(ns.sides, r + i)
                say(f"repeat {r}/{ns.repeats}, concurrency {c}, {prompts_for(ns, c)} prompts "
                    f"({' then '.join(order)})")
                pair: dict[str, dict[str, Any]] = {}
                for side in order:
                    url, key_, root = sides[side]
                    others = [p for s, rs in roots.items() if s != side for p in rs
                              if p not in roots[side]]
                    pair[side] = run_one(ns, side, url, key_, model.id, model_path, c, r, log, stamp,
                                         root, switch, others)
                    if side in ns.peer_sides:
                        engine_counts(pair[side]["metrics"], ns.output_len)
                    report.add_cpu(pair[side]["metrics"])
                found = report.check_pair(pair["direct"]["metrics"], pair["gateway"]["metrics"],
                                          prompts_for(ns, c), ns.output_len)
                problems += [f"c={c} repeat {r}: {p}" for p in found]
                # A peer that loses requests or tokens is reported, but does not fail our benchmark.
                for side in ns.peer_sides:
                    found = report.check_sides({"direct": pair["direct"]["metrics"],
                                                side: pair[side]["metrics"]}, prompts_for(ns, c),
                                               ns.output_len)
                    # Without a readable usage chunk the benchmark counts prompt tokens itself.
                    unread = "reported_output_tokens" in pair[side]["metrics"]
                    peer_problems += [f"c={c} repeat {r}: {p}" for p in found if not p.startswith("direct")
                                      and not (unread and p.startswith("prompt tokens differ"))]
                same, total = report.text_agreement(pair["direct"]["texts"], pair["gateway"]["texts"])
                if total and same != total:
                    warnings.append(f"c={c} repeat {r}: {total - same}/{total} streamed texts differ "
                                    "between the sides (greedy decoding; numerics can differ by batch)")
                for side in ns.sides:
                    runs.append({"repeat": r, "concurrency": c, "side": side,
                                 "metrics": pair[side]["metrics"],
                                 "texts_identical_to_other_side": same if side in report.SIDES else None})

        if switch is not None:
            switch.resume_all()
        rss = gateway_rss(ray_address, workdir)
        replicas_rss = replica_rss(sides["gateway"][2] if not ns.gateway_url else None)
        summary = report.medians(runs, ns.concurrencies, ns.sides)
        rat = report.ratios(summary)
        meta = {
            "command": command_line(argv if argv is not None else sys.argv[1:]),
            "timestamp": stamp, "model": model.id, "model_path": model_path,
            "config": str(config), "backend": ns.backend, "endpoint": ENDPOINTS[ns.backend],
            "concurrencies": ns.concurrencies, "repeats": ns.repeats, "input_len": ns.input_len,
            "output_len": ns.output_len, "seed": ns.seed, "smoke": ns.smoke,
            "num_prompts": {str(c): prompts_for(ns, c) for c in ns.concurrencies},
            "gateway": ("external " + sides["gateway"][0]) if ns.gateway_url else "started by the benchmark",
            "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "wall_time_s": round(time.monotonic() - t_start, 1),
            "sides": list(ns.sides),
            "fairness": ({"method": "all engines live"} if switch is None else
                         {"method": "other sides' engines suspended (SIGSTOP) during each run",
                          "settle_s_after_resume": switch.settle_s}),
        }
        table = report.markdown(summary, rat, rss, meta)
        if replicas_rss:
            table += ("- peak RSS per replica process (VmHWM): " + ", ".join(
                f"`{k}` {v / 2**20:.0f} MiB" for k, v in sorted(replicas_rss.items())) + "\n")
        table += "\n" + report.repeats_markdown(runs)
        table += "\n" + report.fairness_markdown(runs, None if switch is None else switch.settle_s)
        if ns.peer_sides:
            table += peers_section(summary, ns, base, meta)
        doc = {
            "meta": meta,
            "summary": {str(c): v for c, v in summary.items()},
            "ratios": {str(c): v for c, v in rat.items()},
            "gateway_peak_rss_bytes": rss, "gateway_peak_rss_bytes_before_runs": rss_before,
            "replica_peak_rss_bytes": replicas_rss,
            "runs": runs, "problems": problems, "warnings": warnings, "passed": not problems,
        }
        if ns.peer_sides:
            doc["side_by_side"] = [
                {**row, "ttft_p50_delta_ms": {str(c): v for c, v in row["ttft_p50_delta_ms"].items()},
                 "tok_s_ratio": {str(c): v for c, v in row["tok_s_ratio"].items()}}
                for row in report.side_by_side(summary, ns.sides)]
            doc["peer_problems"] = peer_problems
            doc["peer_deviations"] = {p: list(peers.DEVIATIONS[p]) for p in ns.peer_sides}
        base.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
        base.with_suffix(".md").write_text(f"Command: `{meta['command']}`\n\n" + table)
        print("\n" + table, flush=True)
        for w in warnings + [f"peer: {p}" for p in peer_problems]:
            say(f"WARN {w}")
        say(f"wrote {base.with_suffix('.json')} and {base.with_suffix('.md')}")
        if problems:
            for p in problems:
                say(f"FAIL {p}")
            say(f"FAIL: {len(problems)} problem(s): requests failed or output tokens were lost")
            code = 1
        else:
            say("PASS: every request completed on both sides, with equal output token counts")
    except (RuntimeError, OSError, ValueError) as exc:
        say(f"FAIL: setup: {exc}")
        code = 2
    except KeyboardInterrupt:
        say("interrupted")
        code = 130
    finally:
        if switch is not None:  # a suspended process would never handle the signal that stops it
            switch.resume_all()
        # The stack first (SIGINT lets the CLI shut Ray down cleanly), then direct vLLM.
        for proc in reversed(started):
            harness.stop(proc, timeout_s=90 if "stack" in proc.name or "Ray" in proc.name else 30,
                         say=say)
        for proc in started:  # keep the server logs beside the results, without the demo key
            if proc.log.exists():
                text = proc.log.read_text(errors="replace")
                text = re.sub(r"(OPENAI_API_KEY=)\S+", r"\1<redacted>", text)
                (base.parent / f"{base.name}.{proc.log.stem}.log").write_text(text)
        shutil.rmtree(workdir, ignore_errors=True)
        say(f"done in {time.monotonic() - t_start:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
