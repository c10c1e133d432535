"""What turning on vLLM's LoRA costs a model's engine, measured by vLLM's own benchmark.

``python -m loadtests.bench.lora_cost`` starts plain vLLM's OpenAI server with the app's engine
arguments for one model (``serve-app engine-args``) twice: once as configured, with LoRA and the
model's adapters (``--enable-lora --lora-modules``), and once with LoRA off. Only one engine is live
at a time: each side is started, measured and stopped in turn, the order alternating by round. Each
run is ``vllm.benchmarks.serve`` (random prompts, fixed output length, streaming chat) at one
concurrency. Per side it reports the median output tokens/s and TTFT p50, the ratio LoRA/plain for
the base model, and, on the LoRA side, the same load sent to the first adapter.

No stack and no gateway: this is the engine's own cost, which every path in front of it inherits.
Results: ``results/bench/lora-cost-<timestamp>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from loadtests.bench import procs, run
from loadtests.bench.procs import ROOT, say
from loadtests.harness import stack as harness

LORA_ARGS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench.lora_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/local.yaml")
    p.add_argument("--model", default="tiny-chat", help="a model of the config with adapters")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="each side runs once per round (medians)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-timeout", type=float, default=900.0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--results-dir", default=str(ROOT / "results" / "bench"))
    ns = p.parse_args(argv)
    ns.backend = "openai-chat"
    return ns


def side_flags(args: dict[str, Any], lora: bool) -> list[str]:
    """api_server flags for one side: as configured (LoRA and the adapters) or with LoRA off."""
    engine_kw = dict(args["engine_kwargs"])
    if not lora:
        engine_kw = {k: v for k, v in engine_kw.items() if k not in LORA_ARGS}
    flags = procs.direct_server_flags(engine_kw, args["frontend"])
    if lora:
        flags += ["--lora-modules", *(f"{name}={path}" for name, path in args["adapters"].items())]
    return flags


def measure(ns: argparse.Namespace, args: dict[str, Any], lora: bool, rnd: int,
            r: procs.Run) -> dict[str, dict[str, Any]]:
    side = "lora" if lora else "plain"
    port = harness.free_port()
    proc = procs.start_direct(side_flags(args, lora), port, args["env"],
                              r.base.with_name(f"{r.base.name}-{side}-r{rnd}.log"))
    try:
        url = f"http://127.0.0.1:{port}"
        t = harness.wait_until(lambda: harness.http_status(f"{url}/health") == 200, [proc],
                               f"vLLM ({side})", ns.startup_timeout, say)
        say(f"vLLM ({side}) ready in {t:.0f} s")
        targets = [ns.model] + ([next(iter(args["adapters"]))] if lora else [])
        out = {}
        for model_id in targets:
            label = side if model_id == ns.model else f"{side}:{model_id}"
            out[label] = run.run_one(ns, label, url, None, model_id, args["model_path"], ns.concurrency,
                                     rnd, r.base.with_suffix(".log"), r.stamp, proc.pid)["metrics"]
        return out
    finally:
        harness.stop(proc)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    r = procs.new_run("lora-cost", "loadtests.bench.lora_cost", ns.config, ns.results_dir, argv)
    config = r.config
    args = run.engine_args(config, ns.model)
    if not args.get("adapters") or not args["engine_kwargs"].get("enable_lora"):
        raise SystemExit(f"{ns.model} has no adapters with enable_lora in {config}: nothing to compare")
    results: dict[str, list[dict[str, Any]]] = {}
    for rnd in range(ns.rounds):
        for lora in ((True, False) if rnd % 2 == 0 else (False, True)):
            for label, metrics in measure(ns, args, lora, rnd, r).items():
                results.setdefault(label, []).append(metrics)
    summary = {label: {"output_tok_s": statistics.median(m["output_tok_s"] for m in runs),
                       "ttft_p50_ms": statistics.median(m["ttft_p50_ms"] for m in runs),
                       "failed": sum(m["failed"] for m in runs), "runs": len(runs)}
               for label, runs in results.items()}
    ratio = summary["lora"]["output_tok_s"] / summary["plain"]["output_tok_s"]
    lines = [f"# LoRA's cost on {ns.model}'s engine ({r.stamp})", "",
             f"`{r.command}`: "
             f"c{ns.concurrency}, {ns.num_prompts} prompts of {ns.input_len} in / {ns.output_len} out, "
             f"{ns.rounds} round(s), one live engine at a time, medians.", "",
             "| side | output tok/s | TTFT p50 | failed |", "|---|---:|---:|---:|"]
    lines += [f"| {label} | {s['output_tok_s']:,.0f} | {s['ttft_p50_ms']:.1f} ms | {s['failed']} |"
              for label, s in summary.items()]
    lines += ["", f"Base model's throughput with LoRA on / off: **{ratio:.2f}x**."]
    md = "\n".join(lines) + "\n"
    procs.write_results(r.base, {"summary": summary, "ratio_lora_over_plain": round(ratio, 3),
                                 "runs": results, "args": vars(ns)}, md)
    print(md)
    return 1 if any(s["failed"] for s in summary.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
