"""Fit a step-time profile to a real engine's benchmark: the ``cpu-tiny`` profile (issue 39).

A benchmark cell is ``vllm bench serve`` at one concurrency: a closed loop of ``concurrency``
clients sending ``num_prompts`` prompts (token ids: ``prefix_len`` tokens shared by every prompt,
then ``input_len`` tokens of its own) for ``output_len`` tokens each (``--ignore-eos``), after
the benchmark's ready check (the first prompt once) and its warm-up (``warmups`` copies of the
first prompt). Its figures are TTFT p50, TPOT p50 and output tokens/s.

``trace`` replays a cell through the simulated engine's own ``Scheduler`` and ``BlockPool``. In a
closed loop the next request arrives when one finishes, at a step boundary, so which requests run
in which step does not depend on how long a step takes: one replay gives every step's work, and
the cell's figures for any profile follow from the steps' times (``figures``). ``fit`` then finds
the profile's coefficients (all >= 0) that minimise the log error of every figure of every cell,
with scipy's least squares (scipy comes with vLLM; nothing of the app needs it).

Re-run the fit from a ``loadtests.bench.sim_validate`` result that holds real cells::

    python -m serve_app.engine.sim.calibrate results/bench/sim-validate-<stamp>.json --write

``--write`` stores the coefficients as the ``cpu-tiny`` profile of ``profiles.json``, with the
data they came from and the fit's error per figure.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_app.engine.sim.blocks import BlockPool
from serve_app.engine.sim.profile import PROFILES_FILE, StepProfile, StepWork
from serve_app.engine.sim.scheduler import Limits, Scheduler, SimRequest

PARAMS = ("overhead_s", "floor_s", "prefill_token_s", "prefill_pair_s", "decode_seq_s", "decode_context_s")
FIGURES = ("ttft_p50_ms", "tpot_p50_ms", "output_tok_s")
ID_RANGE = 1 << 40  # prompt ids: random in a range this large never repeat by chance


@dataclass(frozen=True)
class Cell:
    """One benchmark cell, as ``loadtests.bench.sim_validate`` runs it."""

    name: str
    concurrency: int
    num_prompts: int
    input_len: int
    output_len: int
    prefix_len: int = 0
    warmups: int = 0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Cell:
        return cls(**{k: d[k] for k in ("name", "concurrency", "num_prompts", "input_len", "output_len",
                                        "prefix_len", "warmups") if k in d})


@dataclass(frozen=True)
class EngineShape:
    """The engine arguments that decide the schedule (vLLM's names)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int
    prefix_caching: bool = True


@dataclass(frozen=True)
class Timed:
    """One main-run request of a replayed cell: the steps it arrived after, made its first token
    in and finished in (indices into ``Trace.steps``; ``arrived`` -1: before the first step)."""

    arrived: int
    first: int
    finished: int
    output_len: int


@dataclass(frozen=True)
class Trace:
    """A replayed cell: every step's work, the main run's requests, and where the main run starts."""

    steps: list[StepWork]
    requests: list[Timed]
    main_start: int  # the main run's first request arrives after this many steps


def prompts(cell: Cell, seed: int = 0) -> list[list[int]]:
    """The cell's prompts: one shared prefix, then each prompt's own tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(ID_RANGE) for _ in range(cell.prefix_len)]
    return [prefix + [rng.randrange(ID_RANGE) for _ in range(cell.input_len)]
            for _ in range(cell.num_prompts)]


def trace(cell: Cell, shape: EngineShape, seed: int = 0) -> Trace:
    """Replay ``cell`` (ready check, warm-up, main run) through the simulated scheduler."""
    sched = Scheduler(Limits(max_num_seqs=shape.max_num_seqs,
                             max_num_batched_tokens=shape.max_num_batched_tokens),
                      BlockPool(shape.num_blocks, shape.block_size, caching=shape.prefix_caching))
    steps: list[StepWork] = []
    asked = prompts(cell, seed)

    def closed_loop(todo: Sequence[list[int]], concurrency: int) -> list[Timed]:
        arrived: dict[int, int] = {}
        pending = list(enumerate(todo))[::-1]
        live: dict[SimRequest, int] = {}
        done: list[tuple[int, Timed]] = []

        def submit() -> None:
            while pending and len(live) < concurrency:
                i, ids = pending.pop()
                req = SimRequest(f"r{len(steps)}-{i}", list(ids), cell.output_len,
                                 arrival=float(len(steps)))
                sched.add(req)
                live[req] = i
                arrived[i] = len(steps) - 1

        submit()
        while live:
            batch = sched.schedule()
            if not batch.scheduled:
                raise RuntimeError(f"cell {cell.name}: nothing can be scheduled (KV cache too small?)")
            steps.append(batch.work())
            index = len(steps) - 1
            sched.complete(batch, float(index))
            for req in list(live):
                if req.done:
                    i = live.pop(req)
                    assert req.first_token_at is not None
                    done.append((i, Timed(arrived[i], int(req.first_token_at), index, len(req.outputs))))
            submit()
        return [t for _, t in sorted(done, key=lambda x: x[0])]

    closed_loop(asked[:1], 1)  # the benchmark's ready check
    if cell.warmups:
        closed_loop([asked[0]] * cell.warmups, cell.concurrency)
    start = len(steps)
    return Trace(steps, closed_loop(asked, cell.concurrency), start)


def step_times(profile: StepProfile, steps: Sequence[StepWork]) -> list[float]:
    return [profile.step_s(w) for w in steps]


def figures(profile: StepProfile, tr: Trace) -> dict[str, float]:
    """The cell's TTFT p50 and TPOT p50 (ms) and output tokens/s under ``profile``, as
    ``vllm bench serve`` computes them (TPOT: (latency - TTFT) / (output tokens - 1))."""
    times = step_times(profile, tr.steps)
    ends = [0.0]
    for t in times:
        ends.append(ends[-1] + t)  # ends[i + 1]: when step i ends

    def at(step: int) -> float:  # the time a step ends (-1: before the first)
        return ends[step + 1]

    ttfts = [at(r.first) - at(r.arrived) for r in tr.requests]
    tpots = [(at(r.finished) - at(r.first)) / (r.output_len - 1) for r in tr.requests if r.output_len > 1]
    duration = at(max(r.finished for r in tr.requests)) - ends[tr.main_start]
    out = sum(r.output_len for r in tr.requests)
    return {"ttft_p50_ms": statistics.median(ttfts) * 1000,
            "tpot_p50_ms": statistics.median(tpots) * 1000 if tpots else 0.0,
            "output_tok_s": out / duration if duration > 0 else 0.0}


def profile_of(params: Mapping[str, float], name: str = "fit") -> StepProfile:
    return StepProfile(name=name, overhead_s=float(params["overhead_s"]), floor_s=float(params["floor_s"]),
                       prefill_token_s=float(params["prefill_token_s"]),
                       prefill_pair_s=float(params["prefill_pair_s"]),
                       decode_seq_s=float(params["decode_seq_s"]),
                       decode_context_s=float(params["decode_context_s"]))


def log_errors(profile: StepProfile, traces: Sequence[Trace],
               measured: Sequence[Mapping[str, float]]) -> list[float]:
    """log(simulated / measured) of every figure of every cell."""
    out = []
    for tr, real in zip(traces, measured, strict=True):
        sim = figures(profile, tr)
        out += [math.log(max(sim[f], 1e-9) / real[f]) for f in FIGURES]
    return out


X0 = {"overhead_s": 3e-3, "floor_s": 1e-3, "prefill_token_s": 5e-6, "prefill_pair_s": 1e-10,
      "decode_seq_s": 1e-4, "decode_context_s": 1e-8}


def fit(traces: Sequence[Trace], measured: Sequence[Mapping[str, float]],
        x0: Mapping[str, float] = X0) -> tuple[dict[str, float], list[float]]:
    """The coefficients (each >= 0, searched in log space) that minimise the squared log errors
    of every figure; and the relative errors at them (sim / real - 1, in ``FIGURES`` order)."""
    import numpy as np
    from scipy.optimize import least_squares

    def params(x: Any) -> dict[str, float]:
        return {k: float(math.exp(v)) for k, v in zip(PARAMS, x, strict=True)}

    def residuals(x: Any) -> Any:
        return np.array(log_errors(profile_of(params(x)), traces, measured))

    base = np.log([max(x0[k], 1e-15) for k in PARAMS])
    best = None
    for shift in (0.0, -2.3, 2.3):  # x0, x0 / 10, x0 x 10: the best of three starts
        found = least_squares(residuals, np.minimum(base + shift, -1e-3), method="trf",
                              bounds=(np.full(len(PARAMS), -40.0), np.full(len(PARAMS), 0.0)))
        if best is None or found.cost < best.cost:
            best = found
    assert best is not None
    p = params(best.x)
    return p, [math.exp(e) - 1 for e in log_errors(profile_of(p), traces, measured)]


def source_note(data: str, cells: Sequence[Cell], errs: Sequence[float]) -> str:
    worst = max((abs(e) for e in errs), default=0.0)
    names = ", ".join(c.name for c in cells)
    return (f"FITTED to the real tiny-chat engine on this 2-core CPU (direct vLLM 0.32 CPU with "
            f"configs/local.yaml's engine arguments as shipped, LoRA on, base-model requests), "
            f"measured by vllm bench serve in {data}: cells {names}; each cell replayed through "
            f"the simulated scheduler, TTFT p50, TPOT p50 and output tokens/s fitted together "
            f"(serve_app/engine/sim/calibrate.py); worst figure {worst:.1%} off")


def write_profile(name: str, params: Mapping[str, float], note: str, fit_info: dict[str, Any],
                  path: Path = PROFILES_FILE) -> None:
    doc = json.loads(path.read_text())
    doc["profiles"][name] = {**{k: float(f"{params[k]:.6g}") for k in PARAMS}, "fitted": True,
                             "source": note, "fit": fit_info}
    path.write_text(json.dumps(doc, indent=2) + "\n")


def fit_result(doc: Mapping[str, Any], seed: int = 0,
               fitter: Callable[..., tuple[dict[str, float], list[float]]] = fit,
               ) -> tuple[dict[str, float], list[float], list[Cell], list[dict[str, float]]]:
    """Fit to a ``sim_validate`` result's real cells (its ``engine`` shape, its ``cells`` and
    each cell's ``real`` figures)."""
    shape = EngineShape(**doc["engine"])
    cells = [Cell.from_dict(c) for c in doc["cells"]]
    measured = [{f: float(doc["real"][c.name][f]) for f in FIGURES} for c in cells]
    traces = [trace(c, shape, seed) for c in cells]
    params, errs = fitter(traces, measured)
    return params, errs, cells, measured


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serve_app.engine.sim.calibrate",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("result", help="a loadtests.bench.sim_validate result (.json) with real cells")
    ap.add_argument("--profile", default="cpu-tiny", help="the profile to write")
    ap.add_argument("--write", action="store_true", help=f"store the fit in {PROFILES_FILE.name}")
    ns = ap.parse_args(argv)
    path = Path(ns.result)
    doc = json.loads(path.read_text())
    params, errs, cells, measured = fit_result(doc)
    print("fitted: " + ", ".join(f"{k} {params[k]:.4g}" for k in PARAMS))
    per_cell = {}
    for i, (c, real) in enumerate(zip(cells, measured, strict=True)):
        e = errs[3 * i:3 * i + 3]
        per_cell[c.name] = {f: round(x, 4) for f, x in zip(FIGURES, e, strict=True)}
        print(f"  {c.name:12} " + "  ".join(f"{f} real {real[f]:8.2f} sim {real[f] * (1 + x):8.2f} "
                                             f"({x:+.1%})" for f, x in zip(FIGURES, e, strict=True)))
    if ns.write:
        data = path.name
        write_profile(ns.profile, params, source_note(data, cells, errs), {
            "data": data, "engine": doc["engine"], "cells": [c.__dict__ for c in cells],
            "measured": {c.name: m for c, m in zip(cells, measured, strict=True)},
            "rel_err": per_cell, "max_rel_err": round(max(abs(e) for e in errs), 4)})
        print(f"wrote profile {ns.profile!r} to {PROFILES_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
