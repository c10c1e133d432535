"""loadtests.bench.sim_validate (the simulated engine against the real one, issue 39) and the
simulated engine served on its own (serve_app/engine/sim/http.py, ``serve-app sim-engine``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from loadtests.bench import sim_validate as sv
from serve_app.engine.sim import calibrate
from serve_app.engine.sim.engine import NoStats
from serve_app.engine.sim.http import build_app, standalone_model
from serve_app.engine.sim.server import FINGERPRINT, SimServer
from tests.unit.builders import model
from tests.unit.sim_fakes import FakeClock


def ns(**over: Any) -> Any:
    return sv.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in over.items()])


def test_the_cells_are_c1_c16_c64_and_a_prefix_hit_and_miss_of_equal_length() -> None:
    cells = sv.cells_of(ns())
    assert [c.name for c in cells] == ["c1", "c16", "c64", "prefix-hit", "prefix-miss"]
    assert [c.num_prompts for c in cells[:3]] == [32, 128, 512]
    assert [c.warmups for c in cells[:3]] == [1, 8, 8]
    hit, miss = cells[3:]
    assert hit.prefix_len == 2048 and miss.prefix_len == 0
    assert hit.prefix_len + hit.input_len == miss.input_len == 2176
    assert hit.concurrency == miss.concurrency == 8
    assert [c.name for c in sv.cells_of(sv.parse_args(["--no-prefix", "--concurrency", "4"]))] == ["c4"]
    # The fit reads the cells the bench writes: the same fields on both sides.
    assert [f.name for f in dataclasses.fields(sv.Cell)] == [f.name for f in dataclasses.fields(calibrate.Cell)]


def test_prompts_are_seeded_token_ids_sharing_only_the_hit_cell_s_prefix() -> None:
    hit, miss = sv.cells_of(ns(prefix_len=64, input_len=8))[3:]
    a = sv.token_prompts(hit, 588, seed=0)
    assert a == sv.token_prompts(hit, 588, seed=0) and a != sv.token_prompts(hit, 588, seed=1)
    again = sv.token_prompts(hit, 588, seed=0, repeat=1)  # a repeat shares no prompt with the first run
    assert not {tuple(p) for p in again} & {tuple(p) for p in a}
    assert all(len(p) == 72 and p[:64] == a[0][:64] for p in a)
    assert len({tuple(p[64:]) for p in a}) == len(a)
    b = sv.token_prompts(miss, 588, seed=0)
    assert len({tuple(p[:64]) for p in b}) == len(b)
    assert all(sv.FIRST_ID <= t < 588 for p in a + b for t in p)


def test_compare_gives_the_ratio_per_cell_and_figure_and_marks_those_outside_the_tolerance() -> None:
    real = {"c1": {"ttft_p50_ms": 10.0, "tpot_p50_ms": 5.0, "output_tok_s": 200.0},
            "c16": {"ttft_p50_ms": 40.0, "tpot_p50_ms": 8.0, "output_tok_s": 2000.0}}
    sim = {"c1": {"ttft_p50_ms": 11.5, "tpot_p50_ms": 5.0, "output_tok_s": 169.0},
           "c16": {"ttft_p50_ms": 40.0, "tpot_p50_ms": 8.0, "output_tok_s": 2000.0}}
    rows = sv.compare(real, sim, 0.15)
    c1 = {r["figure"]: r for r in rows if r["cell"] == "c1"}
    assert c1["ttft_p50_ms"]["ratio"] == pytest.approx(1.15) and c1["ttft_p50_ms"]["within"]
    assert c1["output_tok_s"]["ratio"] == pytest.approx(0.845) and not c1["output_tok_s"]["within"]
    md = sv.markdown_table(rows, 0.15)
    assert "| c1 | 10.0 / 11.5 (1.15x) | 5.00 / 5.00 (1.00x) | 200 / 169 (0.84x ⚠) |" in md
    assert "5 of 6 figures within ±15%: outside are c1 output tok/s (0.84x)." in md
    assert sv.compare(real, {}, 0.15) == []


def test_medians_per_cell_and_the_real_engine_s_shape() -> None:
    runs = {"c1": [{"ttft_p50_ms": 1.0, "tpot_p50_ms": 2.0, "output_tok_s": 3.0, "failed": 0},
                   {"ttft_p50_ms": 3.0, "tpot_p50_ms": 4.0, "output_tok_s": 5.0, "failed": 1},
                   {"ttft_p50_ms": 2.0, "tpot_p50_ms": 9.0, "output_tok_s": 4.0, "failed": 0}]}
    assert sv.medians(runs) == {"c1": {"ttft_p50_ms": 2.0, "tpot_p50_ms": 4.0, "output_tok_s": 4.0,
                                       "failed": 1, "runs": 3}}
    text = ('# HELP x\nvllm:cache_config_info{block_size="128",enable_prefix_caching="True",'
            'engine="0",num_gpu_blocks="2048"} 1.0\n')
    cache = sv.cache_config(text)
    assert cache["block_size"] == "128" and cache["num_gpu_blocks"] == "2048"
    shape = sv.engine_shape({"max_num_seqs": 64}, cache)
    assert shape == {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "block_size": 128,
                     "num_blocks": 2048, "prefix_caching": True}
    assert sv.engine_shape({"max_num_seqs": 8, "block_size": 16, "max_num_batched_tokens": 512,
                            "enable_prefix_caching": False}, {})["num_blocks"] == 262_144 // 16
    calibrate.EngineShape(**shape)  # the fit reads it as it is written


def test_a_standalone_model_keeps_the_engine_arguments_but_not_the_adapters_or_kv_bytes() -> None:
    real = model(id="tiny-chat", source="builtin:tiny-chat",
                 adapters=[{"name": "tiny-chat-pirate", "source": "builtin:tiny-chat-pirate"}],
                 engine={"enable_lora": True, "max_loras": 1, "max_lora_rank": 8, "max_num_seqs": 64,
                         "kv_cache_memory_bytes": 268435456, "scheduling_policy": "priority"})
    sim = standalone_model(real, "cpu-tiny", num_blocks=2048,
                           engine={"block_size": 128, "max_num_batched_tokens": 2048})
    assert sim.simulated is not None and sim.simulated.profile == "cpu-tiny"
    assert sim.simulated.num_blocks == 2048 and sim.simulated.time_scale == 1.0
    assert not sim.adapters and sim.stream_interval_ms == 0
    e = sim.engine
    assert (e.max_num_seqs, e.block_size, e.max_num_batched_tokens, e.scheduling_policy) == (64, 128, 2048, "priority")
    assert e.kv_cache_memory_bytes is None and not e.enable_lora


def test_the_standalone_server_streams_completions_of_token_ids_as_vllm_does() -> None:
    aiohttp_test = pytest.importorskip("aiohttp.test_utils")
    cfg = standalone_model(model(id="tiny-chat"), "cpu-tiny", num_blocks=256)
    server = SimServer(cfg, FakeClock(), NoStats())

    async def main() -> tuple[list[dict[str, Any]], dict[str, Any], int, int]:
        client = aiohttp_test.TestClient(aiohttp_test.TestServer(build_app(server)))
        await client.start_server()
        try:
            body = {"model": "tiny-chat", "prompt": list(range(40)), "max_tokens": 5, "stream": True,
                    "stream_options": {"include_usage": True}}
            resp = await client.post("/v1/completions", json=body)
            text = await resp.text()
            events = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
            chat = await client.post("/v1/chat/completions", json={
                "model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            other = await client.post("/v1/completions", json={**body, "model": "gpt-x"})
            health = await client.get("/health")
            return events, await chat.json(), other.status, health.status
        finally:
            await client.close()

    events, chat, other, health = asyncio.run(main())
    assert events[-1]["usage"] == {"prompt_tokens": 40, "completion_tokens": 5, "total_tokens": 45}
    assert sum(1 for e in events if e["choices"]) == 5  # a token per event: stream_interval_ms 0
    assert events[0]["system_fingerprint"] == FINGERPRINT
    assert chat["usage"]["completion_tokens"] == 3 and chat["id"].startswith("sim-")
    assert (other, health) == (404, 200)
