"""serve_app.engine.sim.calibrate: replaying a benchmark cell through the simulated scheduler, the
cell's figures under a profile, and fitting a profile to measured figures (issue 39's cpu-tiny)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serve_app.engine.sim.calibrate import (
    FIGURES,
    PARAMS,
    Cell,
    EngineShape,
    figures,
    fit,
    fit_result,
    profile_of,
    prompts,
    trace,
    write_profile,
)
from serve_app.engine.sim.profile import StepProfile

SHAPE = EngineShape(max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_blocks=4096)


def flat(step_s: float = 0.01) -> StepProfile:
    """Every step takes the same time."""
    return StepProfile("flat", overhead_s=step_s, prefill_token_s=0, prefill_pair_s=0, decode_seq_s=0,
                       decode_context_s=0)


def test_a_lone_request_takes_one_prefill_step_then_a_step_per_token() -> None:
    cell = Cell("c1", concurrency=1, num_prompts=4, input_len=100, output_len=10)
    got = figures(flat(0.01), trace(cell, SHAPE))
    assert got["ttft_p50_ms"] == pytest.approx(10.0)  # the prompt fits one step's budget
    assert got["tpot_p50_ms"] == pytest.approx(10.0)
    assert got["output_tok_s"] == pytest.approx(100.0)  # a token per 10 ms step


def test_a_long_prompt_is_chunked_and_concurrent_requests_share_steps() -> None:
    # The ready check sent the first prompt before: it hits (one step), the other two do not.
    long = figures(flat(0.01), trace(Cell("long", 1, 3, 600, 4), SHAPE))
    assert long["ttft_p50_ms"] == pytest.approx(30.0)  # 600 tokens at 256 a step: three steps
    c8 = trace(Cell("c8", 8, 16, 10, 5), SHAPE)
    assert max(w.decode_seqs for w in c8.steps) == 8  # max_num_seqs bounds the batch
    fig = figures(flat(0.01), c8)
    assert fig["output_tok_s"] == pytest.approx(800.0, rel=0.01)  # eight tokens a step


def test_the_ready_check_and_warmup_cache_the_prefix_so_every_main_request_hits() -> None:
    hit = trace(Cell("hit", 4, 8, 32, 4, prefix_len=256, warmups=4), SHAPE)
    miss = trace(Cell("miss", 4, 8, 288, 4, warmups=4), SHAPE)
    prefill = [sum(w.prefill_tokens for w in t.steps[t.main_start:]) for t in (hit, miss)]
    # The first main prompt is the ready check's and warm-up's: all but its last block (272 of
    # 288 tokens; one token is always computed) is cached, in either cell.
    assert prefill == [7 * 32 + 16, 8 * 288 - 272]
    assert len(prompts(Cell("x", 1, 3, 5, 1, prefix_len=7))) == 3
    a, b = prompts(Cell("x", 1, 2, 5, 1, prefix_len=7))
    assert a[:7] == b[:7] and a[7:] != b[7:]


def test_figures_follow_the_profile_with_no_second_replay() -> None:
    tr = trace(Cell("c4", 4, 16, 64, 8, warmups=2), SHAPE)
    slow, fast = figures(flat(0.02), tr), figures(flat(0.01), tr)
    assert slow["ttft_p50_ms"] == pytest.approx(2 * fast["ttft_p50_ms"])
    assert slow["output_tok_s"] == pytest.approx(fast["output_tok_s"] / 2)


def test_the_fit_recovers_a_known_profile_from_its_own_figures() -> None:
    pytest.importorskip("scipy")
    truth = {"overhead_s": 4e-3, "floor_s": 1e-3, "prefill_token_s": 2e-5, "prefill_pair_s": 3e-9,
             "decode_seq_s": 3e-4, "decode_context_s": 2e-7}
    cells = [Cell("c1", 1, 8, 64, 16, warmups=1), Cell("c8", 8, 32, 64, 16, warmups=8),
             Cell("hit", 4, 16, 32, 16, prefix_len=512, warmups=4),
             Cell("miss", 4, 16, 544, 16, warmups=4)]
    traces = [trace(c, SHAPE) for c in cells]
    measured = [figures(profile_of(truth), t) for t in traces]
    params, errs = fit(traces, measured)
    assert set(params) == set(PARAMS) and all(v >= 0 for v in params.values())
    assert len(errs) == len(cells) * len(FIGURES)
    assert max(abs(e) for e in errs) < 0.02


def test_a_validate_result_is_fitted_and_written_as_a_profile(tmp_path: Path) -> None:
    doc = {"engine": {"max_num_seqs": 8, "max_num_batched_tokens": 256, "block_size": 16, "num_blocks": 512},
           "cells": [{"name": "c1", "concurrency": 1, "num_prompts": 4, "input_len": 16,
                      "output_len": 4, "prefix_len": 0, "warmups": 1}],
           "real": {"c1": {"ttft_p50_ms": 10.0, "tpot_p50_ms": 10.0, "output_tok_s": 100.0}}}
    seen = {}

    def fake_fit(traces: list[object], measured: list[dict[str, float]]) -> tuple[dict[str, float], list[float]]:
        seen["n"] = (len(traces), measured)
        return {k: 0.001 for k in PARAMS}, [0.0, 0.0, 0.0]

    params, errs, cells, measured = fit_result(doc, fitter=fake_fit)
    assert seen["n"] == (1, [{"ttft_p50_ms": 10.0, "tpot_p50_ms": 10.0, "output_tok_s": 100.0}])
    assert cells == [Cell("c1", 1, 4, 16, 4, 0, 1)]
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps({"profiles": {"other": {"overhead_s": 1}}}))
    write_profile("cpu-tiny", params, "FITTED to test data", {"max_rel_err": 0.0}, profiles)
    got = json.loads(profiles.read_text())["profiles"]
    assert got["other"] == {"overhead_s": 1}
    assert got["cpu-tiny"]["fitted"] is True and got["cpu-tiny"]["source"] == "FITTED to test data"
    assert {k: got["cpu-tiny"][k] for k in PARAMS} == {k: 0.001 for k in PARAMS}
