"""The fair benchmark, without running it: which engine processes are suspended for each side's run,
that everything is resumed before shutdown, and the CPU accounting of the front ends."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from loadtests.bench import peers as bench_peers
from loadtests.bench import procs
from loadtests.bench import report as report
from loadtests.bench import run as bench

# pid -> (parent pid, label), as procs.process_table reads /proc.
TABLE: dict[int, tuple[int, str]] = {
    # direct vLLM: its API server, the engine core and the engine's worker; a multiprocessing helper
    10: (1, "python -m vllm.entrypoints.openai.api_server"),
    11: (10, "VLLM::EngineCore"),
    12: (11, "VLLM::Worker"),
    13: (10, "python -c"),
    # the stack: serve-app run -> raylet -> replicas -> engines (chat and embedding), HAProxy
    20: (1, "python -m serve_app.cli"),
    21: (20, "raylet"),
    22: (21, "ray::ServeReplica:llm:model-tiny-chat"),
    23: (22, "VLLM::EngineCore"),
    24: (23, "VLLM::Worker"),
    25: (21, "ray::ServeReplica:llm:model-minilm"),
    26: (25, "VLLM::EngineCore"),
    27: (26, "python -c"),  # anything below an engine is the engine's
    28: (21, "ray::ServeReplica:llm:gateway"),
    29: (21, "haproxy"),
    # Ray Serve LLM, its own Ray cluster
    30: (1, "python -m loadtests.bench.peer_rayserve"),
    31: (30, "raylet"),
    32: (31, "ray::ServeReplica:rayserve-llm:LLMServer:tiny-chat"),
    33: (32, "VLLM::EngineCore"),
    # the LiteLLM proxy, in front of direct vLLM
    40: (1, "litellm"),
    # not ours: never touched
    50: (1, "VLLM::EngineCore"),
}
ROOTS = {"direct": [10], "gateway": [20], "rayserve": [30], "litellm": [40, 10]}


def test_engine_processes_are_found_below_each_sides_root_and_front_ends_are_not() -> None:
    assert procs.engine_pids([10], TABLE) == {11, 12}
    assert procs.engine_pids([20], TABLE) == {23, 24, 26, 27}
    assert procs.engine_pids([30], TABLE) == {33}
    assert procs.engine_pids([40], TABLE) == set()
    assert procs.engine_pids([40, 10], TABLE) == {11, 12}
    assert procs.engine_pids([999], TABLE) == set()


def test_only_the_side_under_test_keeps_its_engines() -> None:
    engines = {side: procs.engine_pids(roots, TABLE) for side, roots in ROOTS.items()}
    stop, live = procs.suspension_plan(engines, "gateway")
    assert live == {23, 24, 26, 27} and stop == {11, 12, 33}
    stop, live = procs.suspension_plan(engines, "direct")
    assert live == {11, 12} and stop == {23, 24, 26, 27, 33}
    # The LiteLLM proxy's engine is direct vLLM's: live while the proxy is measured.
    stop, live = procs.suspension_plan(engines, "litellm")
    assert live == {11, 12} and stop == {23, 24, 26, 27, 33}
    assert 50 not in stop | live
    assert procs.suspension_plan({}, "direct") == (set(), set())


class FakeKernel:
    """Signals and /proc for EngineSwitch: records every signal, tracks stopped processes."""

    def __init__(self, table: dict[int, tuple[int, str]]) -> None:
        self.table = dict(table)
        self.sent: list[tuple[int, int]] = []
        self.stopped: set[int] = set()
        self.slept: list[float] = []

    def kill(self, pid: int, sig: int) -> None:
        if pid not in self.table:
            raise ProcessLookupError(pid)
        self.sent.append((pid, sig))
        if sig == signal.SIGSTOP:
            self.stopped.add(pid)
        elif sig == signal.SIGCONT:
            self.stopped.discard(pid)

    def state(self, pid: int) -> str | None:
        return None if pid not in self.table else "T" if pid in self.stopped else "S"

    def switch(self, settle_s: float = 1.0) -> procs.EngineSwitch:
        return procs.EngineSwitch(ROOTS, settle_s=settle_s, kill=self.kill, sleep=self.slept.append,
                                  table=lambda: self.table, state=self.state)


def test_a_run_suspends_the_other_sides_engines_resumes_its_own_and_waits() -> None:
    k = FakeKernel(TABLE)
    sw = k.switch()
    rec = sw.only("direct")
    assert k.stopped == {23, 24, 26, 27, 33}
    assert rec == {"live": 2, "suspended": {"gateway": 4, "rayserve": 1}, "suspended_verified": True,
                   "settle_s": 1.0}
    assert k.slept == [1.0]  # the settle time; no polling, every engine was seen stopped at once
    rec = sw.only("gateway")
    assert k.stopped == {11, 12, 33}
    assert (23, signal.SIGCONT) in k.sent and (24, signal.SIGCONT) in k.sent
    assert rec["suspended"] == {"direct": 2, "litellm": 2, "rayserve": 1}
    assert 50 not in {pid for pid, _ in k.sent}


def test_everything_suspended_is_resumed_before_shutdown_even_if_an_engine_is_gone() -> None:
    k = FakeKernel(TABLE)
    sw = k.switch()
    sw.only("rayserve")
    assert k.stopped == {11, 12, 23, 24, 26, 27}
    del k.table[26]  # a replica was replaced meanwhile; its old engine is gone
    sw.resume_all()
    assert k.stopped == {26}  # only the vanished process, which no signal reaches
    assert sw.suspended == set()


def test_a_suspended_engine_that_is_not_seen_stopped_is_reported() -> None:
    k = FakeKernel(TABLE)
    sw = procs.EngineSwitch(ROOTS, kill=lambda pid, sig: None, sleep=lambda s: None,
                            table=lambda: k.table, state=lambda pid: "R")
    assert sw.only("direct")["suspended_verified"] is False
    # SIGSTOP takes effect when the process is next scheduled: a late stop still counts.
    seen = iter(["R"] * 3 + ["T"] * 100)
    slept: list[float] = []
    sw = procs.EngineSwitch(ROOTS, settle_s=0.0, kill=lambda pid, sig: None, sleep=slept.append,
                            table=lambda: k.table, state=lambda pid: next(seen))
    assert sw.only("direct")["suspended_verified"] is True and 0.1 in slept


# ---- CPU accounting ---------------------------------------------------------------------------------
def test_front_end_cpu_is_every_server_process_but_the_engines_per_1000_tokens() -> None:
    m = {"total_output_tokens": 2000, "cpu_s": {
        "python -m vllm.entrypoints.openai.api_server": 0.4, "VLLM::EngineCore": 3.0,
        "VLLM::Worker": 1.0, report.CLIENT: 2.0}}
    report.add_cpu(m)
    assert m["frontend_cpu_s"] == 0.4 and m["engine_cpu_s"] == 4.0
    assert m["frontend_cpu_per_1k"] == pytest.approx(0.2)
    stack = {"total_output_tokens": 4000, "cpu_s": {
        "ray::ServeReplica:llm:gateway": 0.8, "ray::ServeReplica:llm:model-tiny-chat": 0.6,
        "haproxy": 0.1, "raylet": 0.1, "VLLM::EngineCore": 5.0}}
    report.add_cpu(stack)
    assert stack["frontend_cpu_per_1k"] == pytest.approx(0.4)


def test_a_side_without_accounted_processes_has_no_cpu_figure() -> None:
    m = report.run_metrics({})
    m["cpu_s"] = {report.CLIENT: 1.0}
    report.add_cpu(m)
    assert m["frontend_cpu_s"] is None and m["frontend_cpu_per_1k"] is None


def test_cpu_used_during_a_run_is_the_difference_of_two_readings() -> None:
    before = {"raylet": 10.0, "haproxy": 2.0, "gone": 5.0}
    after = {"raylet": 10.5, "haproxy": 2.01, "VLLM::EngineCore": 3.0}  # a new process counts from 0
    assert report.cpu_delta(before, after) == {"VLLM::EngineCore": 3.0, "raylet": 0.5}
    assert report.cpu_delta(before, after, floor=0.0)["haproxy"] == pytest.approx(0.01)


def _run(side: str, front: float | None, engines: dict[str, Any] | None = None,
         bg: float = 0.1) -> dict[str, Any]:
    m = {**report.run_metrics({"completed": 4, "output_throughput": 100.0}),
         "frontend_cpu_per_1k": front, "background_cpu_s": bg}
    if engines is not None:
        m["engines"] = engines
    return {"repeat": 1, "concurrency": 64, "side": side, "metrics": m}


def test_front_end_cpu_is_a_column_of_the_table_with_the_median_of_the_runs() -> None:
    runs = [_run("direct", 0.15), _run("direct", 0.17), _run("direct", None),
            _run("gateway", 0.40), _run("gateway", 0.50), _run("gateway", 0.46)]
    summary = report.medians(runs, [64])
    assert summary[64]["direct"]["frontend_cpu_per_1k"] == pytest.approx(0.16)
    assert summary[64]["gateway"]["frontend_cpu_per_1k"] == pytest.approx(0.46)
    meta = {"repeats": 3, "backend": "openai-chat", "endpoint": "/v1/chat/completions",
            "input_len": 128, "output_len": 64, "seed": 0, "num_prompts": {"64": 512}}
    md = report.markdown(summary, report.ratios(summary), None, meta)
    assert "Front-end CPU-s per 1k tok |" in md and "| 0.460 |" in md
    assert "front-end CPU-s per 1,000 output tokens at c64: direct **0.160**, gateway **0.460**" in md


def test_the_report_says_which_engines_were_live_during_each_sides_runs() -> None:
    runs = [_run("direct", 0.2, {"live": 2, "suspended": {"gateway": 4}, "suspended_verified": True,
                                 "settle_s": 1.0}, bg=0.3),
            _run("gateway", 0.4, {"live": 4, "suspended": {"direct": 2}, "suspended_verified": True,
                                  "settle_s": 1.0}, bg=0.1)]
    md = report.fairness_markdown(runs, 1.0)
    assert "Only the side under test had a live vLLM engine" in md and "1 s later" in md
    assert "| direct | 2 | gateway 4 | 0.30 |" in md
    assert "| gateway | 4 | direct 2 | 0.10 |" in md
    assert "WARNING" not in md
    bad = [_run("gateway", 0.4, {"live": 0, "suspended": {}, "suspended_verified": False,
                                 "settle_s": 1.0})]
    md = report.fairness_markdown(bad, 1.0)
    assert "not seen stopped" in md and "no engine process found" in md
    assert "Fairness: none" in report.fairness_markdown([_run("direct", 0.2)], None)


# ---- command line ------------------------------------------------------------------------------
def test_suspension_is_the_default_and_the_peers_venvs_can_come_from_elsewhere(tmp_path: Path) -> None:
    assert bench.parse_args([]).no_suspend is False
    assert bench.parse_args(["--no-suspend"]).no_suspend is True
    assert bench.roots_of(None) == [] and bench.roots_of(7) == [7] and bench.roots_of([4, 7]) == [4, 7]
    dirs = bench_peers.venv_dirs(tmp_path / "results", tmp_path / "shared")
    assert dirs["rayserve"] == tmp_path / "shared/rayserve-llm"


def test_the_stack_runs_the_shipped_config_with_an_unlimited_tier(tmp_path: Path) -> None:
    """The stack's config is configs/local.yaml as shipped, plus the benchmark's unlimited tier."""
    from loadtests.harness.stack import ROOT, copy_config, read_config

    shipped = read_config(ROOT / "configs/local.yaml")
    cfg = read_config(copy_config(ROOT / "configs/local.yaml", tmp_path / "serve.yaml", port=1234,
                                  keys_file=tmp_path / "keys.yaml",
                                  edit=bench.stack_edit(0)))
    assert bench.BENCH_TIER in cfg.tiers
    assert cfg.models == shipped.models and cfg.gateway.num_replicas == shipped.gateway.num_replicas
