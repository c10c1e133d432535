"""Fit the simulated engine's GPU step-time profiles to NVIDIA aiconfigurator's vLLM data.

``aiconfigurator-core`` (Apache-2.0, CPU-only, on PyPI) ships per-op kernel latencies measured on
H100/H200/... for vLLM and predicts a step's time from them. This script samples its predictions
for prefill steps (prompt length x cached share) and decode steps (batch x context), fits the
coefficients of ``serve_app/engine/sim/profile.py``'s model to them (least squares on relative
error), and writes them into ``serve_app/engine/sim/profiles.json`` with their source and fit
error. It is not a dependency of the project: run it from a throwaway environment::

    python3 -m venv /tmp/aic && /tmp/aic/bin/pip install aiconfigurator-core==0.12.0
    /tmp/aic/bin/python -m loadtests.sim.fit_profiles            # from the repository root

Nothing of serve_app is imported (loadtests is a black box over HTTP); the JSON is the contract.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "serve_app" / "engine" / "sim" / "profiles.json"
PARAMS = ("overhead_s", "floor_s", "prefill_token_s", "prefill_pair_s", "decode_seq_s", "decode_context_s")
PROMPTS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
CACHED_SHARES = (0.0, 0.25, 0.5, 0.75)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXTS = (256, 1024, 4096, 16384)


@dataclass(frozen=True)
class Target:
    """One profile: a model on a GPU at a tensor-parallel size, in aiconfigurator's names."""

    name: str
    model: str
    system: str
    tp: int


TARGETS = (
    Target("h100-llama3.1-8b", "meta-llama/Meta-Llama-3.1-8B", "h100_sxm", 1),
    Target("h100-llama3.1-8b-tp2", "meta-llama/Meta-Llama-3.1-8B", "h100_sxm", 2),
    Target("h200-llama3.1-8b", "meta-llama/Meta-Llama-3.1-8B", "h200_sxm", 1),
    Target("h200-llama3.1-8b-tp2", "meta-llama/Meta-Llama-3.1-8B", "h200_sxm", 2),
    Target("h100-llama3.1-70b-tp4", "meta-llama/Meta-Llama-3.1-70B", "h100_sxm", 4),
)

# (prefill tokens, prefill token pairs, decode sequences, decode context tokens, latency s)
Point = tuple[float, float, float, float, float]


def samples(t: Target) -> list[Point]:
    """aiconfigurator's predicted step latencies for ``t`` (prefill steps, then decode steps)."""
    from aiconfigurator_core.sdk.engine import EngineHandle

    h = EngineHandle.compile(t.model, t.system, "vllm", tp_size=t.tp)
    points: list[Point] = []
    for isl in PROMPTS:
        for share in CACHED_SHARES:
            prefix = int(isl * share)
            new = isl - prefix
            ms = h.predict_prefill_latency(1, isl, prefix)
            points.append((new, new * (prefix + new / 2), 0, 0, ms / 1000))
    for bs in BATCHES:
        for ctx in CONTEXTS:
            ms = h.decode_step_latency(bs, ctx, 2)
            points.append((0, 0, bs, bs * (ctx + 1), ms / 1000))
    return points


def model_s(p: dict[str, float], pt: Point) -> float:
    """The profile's step time (profile.StepProfile.step_s, restated: no serve_app import)."""
    pre, pairs, seqs, ctx, _ = pt
    linear = p["prefill_token_s"] * pre + p["decode_seq_s"] * seqs
    return (p["overhead_s"] + max(p["floor_s"], linear) + p["prefill_pair_s"] * pairs
            + p["decode_context_s"] * ctx)


def fit(points: list[Point]) -> tuple[dict[str, float], float, float]:
    """Coefficients (all >= 0) minimising the log error; and the median and max relative error."""
    import numpy as np
    from scipy.optimize import least_squares

    def params(x: Any) -> dict[str, float]:
        return dict(zip(PARAMS, (float(math.exp(v)) for v in x), strict=True))

    def residuals(x: Any) -> Any:
        p = params(x)
        return np.array([math.log(model_s(p, pt) / pt[4]) for pt in points])

    x0 = np.log([1e-3, 5e-3, 2e-5, 1e-9, 2e-5, 4e-8])
    best = least_squares(residuals, x0, method="trf")
    p = params(best.x)
    errs = sorted(abs(model_s(p, pt) / pt[4] - 1) for pt in points)
    return p, errs[len(errs) // 2], errs[-1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help="profile names to fit (default: all)")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)  # the package logs each fallback table it loads
    doc = json.loads(PROFILES.read_text())
    pkg = f"aiconfigurator-core {version('aiconfigurator-core')}"
    for t in TARGETS:
        if args.only and t.name not in args.only:
            continue
        points = samples(t)
        p, median, worst = fit(points)
        doc["profiles"][t.name] = {
            **{k: float(f"{p[k]:.6g}") for k in PARAMS}, "fitted": True,
            "source": f"FITTED to {pkg}'s vLLM step predictions (its per-op kernel data, "
                      f"{t.system}, vLLM backend), {t.model}, TP {t.tp}: {len(points)} steps "
                      f"(prefill {PROMPTS[0]}-{PROMPTS[-1]} tokens x cached share "
                      f"{', '.join(str(s) for s in CACHED_SHARES)}; decode batch {BATCHES[0]}-"
                      f"{BATCHES[-1]} x context {CONTEXTS[0]}-{CONTEXTS[-1]}); relative error "
                      f"median {median:.1%}, max {worst:.1%} (loadtests/sim/fit_profiles.py)",
            "fit": {"points": len(points), "median_rel_err": round(median, 4),
                    "max_rel_err": round(worst, 4),
                    "reference_ms": reference(t)},
        }
        print(f"{t.name}: median {median:.1%} max {worst:.1%} {p}")
    PROFILES.write_text(json.dumps(doc, indent=2) + "\n")


def reference(t: Target) -> dict[str, float]:
    """aiconfigurator's own figures for a few steps, kept beside the fit to compare against."""
    from aiconfigurator_core.sdk.engine import EngineHandle

    h = EngineHandle.compile(t.model, t.system, "vllm", tp_size=t.tp)
    return {"prefill_2048": round(h.predict_prefill_latency(1, 2048, 0), 3),
            "prefill_2048_half_cached": round(h.predict_prefill_latency(1, 2048, 1024), 3),
            "decode_bs1_ctx2048": round(h.decode_step_latency(1, 2048, 2), 3),
            "decode_bs64_ctx2048": round(h.decode_step_latency(64, 2048, 2), 3)}


if __name__ == "__main__":
    main()
