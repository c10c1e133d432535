"""The benchmark's peers and scenarios, without running them: command lines, venv layout, configs
given to each peer, the side-by-side report, and the capacity rule of the gateway benchmark."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loadtests.bench import gateway as bench_gateway
from loadtests.bench import peers as bench_peers
from loadtests.bench import prefix as bench_prefix
from loadtests.bench import report as report
from loadtests.bench import run as bench
from serve_app.config import AppConfig
from tests.unit.builders import shipped_args

ENGINE_KW = {"model": "/m/tiny", "served_model_name": ["tiny-chat"], "dtype": "float32",
             "max_num_seqs": 64, "enforce_eager": True}


# ---- command line ------------------------------------------------------------------------------
def test_peers_flag_adds_both_peers_and_rejects_unknown_ones() -> None:
    assert bench.parse_args([]).sides == ("direct", "gateway")
    assert bench.parse_args(["--peers"]).sides == ("direct", "gateway", "rayserve", "litellm")
    assert bench.parse_args(["--peers", "litellm"]).peer_sides == ("litellm",)
    with pytest.raises(SystemExit):
        bench.parse_args(["--peers", "ray[llm]"])


# ---- venvs -------------------------------------------------------------------------------------
def test_each_peer_has_its_own_venv_under_the_results_folder(tmp_path: Path) -> None:
    dirs = bench_peers.venv_dirs(tmp_path)
    assert dirs["rayserve"] == tmp_path / "peers/venvs/rayserve-llm"
    assert dirs["litellm"] == tmp_path / f"peers/venvs/litellm-{bench_peers.LITELLM_VERSION}"


def test_rayserve_venv_reuses_the_project_packages_and_never_installs_ray_llm(tmp_path: Path) -> None:
    venv = tmp_path / "rs"
    commands, files = bench_peers.install_plan("rayserve", venv, site_packages="/proj/site-packages")
    assert commands[0][-2:] == ["venv", str(venv)]
    install = commands[1]
    assert install[0] == str(venv / "bin/python") and "--no-deps" in install
    assert set(bench_peers.RAYSERVE_EXTRA) <= set(install)
    assert not any("ray" in a and "llm" in a for c in commands for a in c)
    [(pth, text)] = files.items()
    assert pth.endswith(".pth") and "site-packages" in pth and text == "/proj/site-packages\n"


def test_litellm_is_pinned_and_never_the_compromised_release(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    commands, files = bench_peers.install_plan("litellm", tmp_path / "ll")
    assert commands[1][-1] == "litellm[proxy]==1.83.10" and not files
    assert bench_peers.LITELLM_VERSION not in bench_peers.COMPROMISED_LITELLM
    monkeypatch.setattr(bench_peers, "LITELLM_VERSION", "1.107.0")
    with pytest.raises(SystemExit, match="compromised"):
        bench_peers.install_plan("litellm", tmp_path / "ll")


# ---- what each peer gets -----------------------------------------------------------------------
def test_rayserve_gets_the_same_engine_arguments_on_cpu() -> None:
    cfg = bench_peers.rayserve_llm_config("tiny-chat", "/m/tiny", ENGINE_KW, {"VLLM_CPU_OMP_THREADS_BIND": "0"})
    assert cfg["model_loading_config"] == {"model_id": "tiny-chat", "model_source": "/m/tiny"}
    assert cfg["engine_kwargs"] == {"dtype": "float32", "max_num_seqs": 64, "enforce_eager": True}
    assert cfg["accelerator_config"] == {"kind": "cpu"}
    assert cfg["runtime_env"] == {"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "0"}}
    cmd = bench_peers.rayserve_command(Path("/v/bin/python"), Path("/w/spec.json"))
    assert cmd == ["/v/bin/python", "-m", "loadtests.bench.peer_rayserve", "/w/spec.json"]


def test_litellm_fronts_direct_vllm_on_loopback_without_telemetry_or_remote_fetches() -> None:
    cfg = bench_peers.litellm_config("tiny-chat", "http://127.0.0.1:9000")
    [entry] = cfg["model_list"]
    assert entry["model_name"] == "tiny-chat"
    assert entry["litellm_params"]["model"] == "openai/tiny-chat"
    assert entry["litellm_params"]["api_base"] == "http://127.0.0.1:9000/v1"
    cmd = bench_peers.litellm_command(Path("/v"), Path("/w/l.yaml"), 4000)
    assert cmd[0] == "/v/bin/litellm"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--telemetry") + 1] == "False"
    env = bench_peers.litellm_env({"DATABASE_URL": "postgres://x", "LITELLM_MASTER_KEY": "k", "PATH": "/bin"})
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True" and env["PATH"] == "/bin"
    assert "DATABASE_URL" not in env and "LITELLM_MASTER_KEY" not in env


def test_every_peer_lists_its_deviations() -> None:
    text = bench_peers.deviations_markdown(report.PEER_SIDES)
    for peer in report.PEER_SIDES:
        assert f"- {peer}: " in text


# ---- report ------------------------------------------------------------------------------------
def _side(tok_s: float, ttft: float, cpu: dict[str, float]) -> dict[str, Any]:
    return {"output_tok_s": tok_s, "ttft_p50_ms": ttft, "tpot_p50_ms": 5.0, "total_output_tokens": 1000,
            "cpu_s": cpu}


SUMMARY = {
    1: {"direct": _side(200, 15, {}), "gateway": _side(190, 19, {}), "rayserve": _side(150, 75, {}),
        "litellm": _side(170, 36, {})},
    64: {"direct": _side(3000, 150, {"python -m vllm.entrypoints.openai.api_server": 0.2,
                                      "VLLM::EngineCore": 1.0, "benchmark client": 0.5}),
         "gateway": _side(1500, 400, {"ray::ServeReplica:llm:gateway": 0.2, "VLLM::EngineCore": 1.0}),
         "rayserve": _side(1000, 900, {}), "litellm": _side(1050, 800, {})},
}


def test_side_by_side_compares_every_server_with_direct_vllm() -> None:
    rows = {r["side"]: r for r in report.side_by_side(SUMMARY, ("direct", "gateway", "rayserve", "litellm"))}
    assert set(rows) == {"gateway", "rayserve", "litellm"}
    assert rows["gateway"]["ttft_p50_delta_ms"][1] == pytest.approx(4.0)
    assert rows["rayserve"]["tok_s_ratio"][64] == pytest.approx(1 / 3)
    md = report.side_by_side_markdown(SUMMARY, ("direct", "gateway", "rayserve", "litellm"))
    assert "| Ray Serve LLM | +60.0 ms | 0.75x | 0.33x |" in md
    assert "| direct vLLM | 15.0 ms | 200 tok/s | 3000 tok/s |" in md


def test_cpu_table_separates_the_engine_from_the_front_end() -> None:
    md = report.cpu_markdown(SUMMARY, 64, ("direct", "gateway"))
    assert "| direct vLLM | `python -m vllm.entrypoints.openai.api_server` | 0.200 |" in md
    assert "| direct vLLM | **front end (all but the engine's processes)** | **0.200** |" in md
    assert "benchmark client" not in md


def test_a_peer_that_loses_tokens_is_named() -> None:
    ok = {"completed": 4, "failed": 0, "total_output_tokens": 64, "total_input_tokens": 40, "errors": []}
    lost = {**ok, "total_output_tokens": 60}
    found = report.check_sides({"direct": ok, "litellm": lost}, 4, 16)
    assert any(p.startswith("litellm: 60 output tokens") for p in found)


def test_the_chart_is_written(tmp_path: Path) -> None:
    from loadtests.bench import chart as bench_chart

    out = bench_chart.plot(SUMMARY, ("direct", "gateway", "rayserve", "litellm"), tmp_path / "c.png", "t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the gateway and prefix benchmarks' configs ------------------------------------------------
@pytest.mark.parametrize("replicas", [1, 4])
def test_gateway_bench_config_is_valid_with_a_synthetic_model(replicas: int) -> None:
    args = shipped_args()
    bench_gateway.synthetic_edit(replicas, 100.0, 20.0)(args)
    cfg = AppConfig.model_validate(args)
    [model] = cfg.models
    assert model.synthetic is not None and model.synthetic.tokens_per_s == 100.0
    assert cfg.gateway.num_replicas == replicas


def test_capacity_is_the_largest_step_within_the_ttft_budget_over_the_floor() -> None:
    steps = [{"streams": 2, "added_ttft_p50_ms": 6.0, "failed": 0},
             {"streams": 16, "added_ttft_p50_ms": 8.0, "failed": 0},
             {"streams": 64, "added_ttft_p50_ms": 10.9, "failed": 0},
             {"streams": 128, "added_ttft_p50_ms": 15.0, "failed": 0},
             {"streams": 256, "added_ttft_p50_ms": 7.0, "failed": 2}]
    assert bench_gateway.floor_ms(steps) == 6.0
    cap = bench_gateway.capacity(steps, 5.0)
    assert cap is not None and cap["streams"] == 64
    assert bench_gateway.capacity([steps[0], steps[3]], 5.0) == steps[0]


def test_prefix_bench_serves_the_model_with_caching_on_and_off() -> None:
    args = shipped_args()
    bench_prefix.two_models_edit(args)
    cfg = AppConfig.model_validate(args)
    on, off = cfg.model(bench_prefix.CACHED), cfg.model(bench_prefix.UNCACHED)
    assert on.engine.enable_prefix_caching is True and off.engine.enable_prefix_caching is False
    assert on.engine.max_model_len and on.engine.max_model_len >= 12_000
    assert on.env["VLLM_CPU_OMP_THREADS_BIND"] != off.env["VLLM_CPU_OMP_THREADS_BIND"]


def test_a_peer_usage_the_benchmark_cannot_read_is_replaced_by_the_engine_count() -> None:
    m = {"completed": 32, "total_output_tokens": 2498, "duration_s": 10.0, "output_tok_s": 249.8}
    bench.engine_counts(m, 64)
    assert m == {"completed": 32, "total_output_tokens": 2048, "duration_s": 10.0,
                 "output_tok_s": 204.8, "reported_output_tokens": 2498}
    exact = {"completed": 4, "total_output_tokens": 256, "duration_s": 1.0, "output_tok_s": 256.0}
    bench.engine_counts(exact, 64)
    assert "reported_output_tokens" not in exact


def test_sides_alternate_or_rotate_so_each_goes_first_equally_often() -> None:
    assert bench.side_order(("direct", "gateway"), 1) == ["direct", "gateway"]
    assert bench.side_order(("direct", "gateway"), 2) == ["gateway", "direct"]
    four = ("direct", "gateway", "rayserve", "litellm")
    firsts = [bench.side_order(four, step)[0] for step in range(4)]
    assert sorted(firsts) == sorted(four)
    assert all(sorted(bench.side_order(four, step)) == sorted(four) for step in range(4))
