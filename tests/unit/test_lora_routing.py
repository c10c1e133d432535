"""The LoRA routing benchmark's pure parts (loadtests/bench/lora_routing.py): Zipf sampling of the
adapters, counting adapter loads from vLLM's LoRA log lines, the stack edit and the report."""

from __future__ import annotations

import argparse
import json
import logging
import logging.config
import math
from collections import Counter
from pathlib import Path

import pytest

from loadtests.bench import lora_routing as lr

# What vLLM's LoRA manager logs (vllm/lora/model_manager.py), formatted by ``logging_config``.
LOG = """\
101 vllm.lora.model_manager Adding lora. Model id: 1, int id: 1
101 vllm.lora.model_manager Activating LoRA. int id: 1, slot index: 0
101 vllm.lora.model_manager Successfully loaded LoRA weights for module model.layers.0.mlp.down_proj.
101 vllm.lora.model_manager Removing adapter int id: 1
202 vllm.lora.model_manager Activating LoRA. int id: 7, slot index: 3
202 vllm.lora.model_manager Activating LoRA. int id: 8, slot index: 2
202 vllm.other Activating LoRA. int id: 9, slot index: 2
INFO 2026-12-07 10:57:12,848 [core.py:1] Activating LoRA. int id: 9, slot index: 1
"""


# ---- Zipf ---------------------------------------------------------------------------------------------
def test_zipf_weights_fall_with_rank_and_sum_to_one() -> None:
    w = lr.zipf_weights(16, 1.1)
    assert len(w) == 16 and math.isclose(sum(w), 1.0)
    assert all(a > b for a, b in zip(w, w[1:], strict=False))
    assert math.isclose(w[0] / w[1], 2 ** 1.1)
    assert 0.32 < w[0] < 0.34  # the hottest of 16 adapters takes about a third at s 1.1
    assert lr.zipf_weights(4, 0.0) == [0.25] * 4


def test_zipf_sampler_is_seeded_and_follows_the_weights() -> None:
    a, b, c = lr.ZipfSampler(16, 1.1, 7), lr.ZipfSampler(16, 1.1, 7), lr.ZipfSampler(16, 1.1, 8)
    xs = [a() for _ in range(20_000)]
    assert xs[:500] == [b() for _ in range(500)]  # same seed, same sequence
    assert xs[:500] != [c() for _ in range(500)]
    assert set(xs) == set(range(16))
    counts = Counter(xs)
    for i, w in enumerate(lr.zipf_weights(16, 1.1)):
        assert abs(counts[i] / len(xs) - w) < 0.015


def test_adapter_names_are_unique_per_copy_in_rank_order() -> None:
    a, d = lr.adapter_names(lr.AWARE, 16), lr.adapter_names(lr.DEFAULT, 16)
    assert a[0] == "tiny-chat-lora-00" and a[-1] == "tiny-chat-lora-15"
    assert len(set(a) | set(d)) == 32


# ---- counting adapter loads ----------------------------------------------------------------------------
def test_count_lora_events_counts_slot_and_disk_loads_per_engine_process() -> None:
    events = lr.count_lora_events(LOG)
    assert events["slot"] == Counter({"101": 1, "202": 2})  # another logger's line does not count
    assert events["disk"] == Counter({"101": 1})
    assert lr.count_lora_events("") == {"slot": Counter(), "disk": Counter()}


def test_lora_log_counts_only_complete_lines_added_since_the_mark(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    log = lr.LoraLog(path)
    log.mark()  # no file yet
    assert sum(log.since_mark()["slot"].values()) == 0
    path.write_text(LOG)
    log.mark()
    with path.open("a") as f:
        f.write("303 vllm.lora.model_manager Activating LoRA. int id: 2, slot index: 1\n"
                "303 vllm.lora.model_manager Activating LoRA. int id: 3, slot")  # half written
    assert log.since_mark()["slot"] == Counter({"303": 1})


def test_logging_config_sends_the_lora_managers_debug_lines_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "events.log"
    cfg = lr.logging_config(path)
    json.dumps(cfg)  # vLLM reads it from a JSON file
    saved = logging.getLogger(lr.LORA_LOGGER), logging.getLogger("vllm")
    old = [(lg.level, list(lg.handlers), lg.propagate) for lg in saved]
    try:
        logging.config.dictConfig(cfg)
        logging.getLogger(lr.LORA_LOGGER).debug("Activating LoRA. int id: %d, slot index: %d", 4, 0)
        logging.getLogger("vllm.engine").debug("not kept")
        for lg in saved:
            for h in lg.handlers:
                h.flush()
    finally:
        for lg, (level, handlers, propagate) in zip(saved, old, strict=True):
            for h in lg.handlers:
                if h not in handlers:
                    h.close()
            lg.setLevel(level)
            lg.handlers[:] = handlers
            lg.propagate = propagate
    assert sum(lr.count_lora_events(path.read_text())["slot"].values()) == 1
    assert "not kept" not in path.read_text()


# ---- the stack edit --------------------------------------------------------------------------------------
def test_edit_makes_two_copies_with_the_adapters_and_one_router_each(tmp_path: Path) -> None:
    ns = lr.parse_args(["--adapters", "3"])
    folders = [tmp_path / f"a{i}" for i in range(3)]
    confs = {m: tmp_path / f"{m}.json" for m in lr.MODELS}
    args = {"models": [{"id": "tiny-chat", "aliases": ["tiny"], "source": "builtin:tiny-chat",
                        "adapters": [{"name": "tiny-chat-pirate", "source": "builtin:tiny-chat-pirate"}],
                        "engine": {"enable_lora": True, "max_loras": 1}, "admission": {"x": 1},
                        "env": {"A": "1"}},
                       {"id": "minilm-embed"}],
            "routes": [{"x": 1}]}
    lr.edit_for(ns, folders, confs)(args)
    aware, default = args["models"]
    assert [aware["id"], default["id"]] == [lr.AWARE, lr.DEFAULT]
    assert aware["routing"] == {"affinity": "on"} and default["routing"] == {"affinity": "off"}
    for m in (aware, default):
        assert [a["source"] for a in m["adapters"]] == [str(f) for f in folders]
        assert m["engine"]["max_loras"] == 4 and m["engine"]["max_cpu_loras"] == 4
        assert m["deployment"]["num_replicas"] == 2 and m["aliases"] == [] and "admission" not in m
        assert m["env"]["VLLM_LOGGING_CONFIG_PATH"] == str(confs[m["id"]]) and m["env"]["A"] == "1"
    assert {a["name"] for a in aware["adapters"]}.isdisjoint(a["name"] for a in default["adapters"])
    assert args["routes"] == [] and args["default_tier"] == lr.TIER


# ---- summary and report ------------------------------------------------------------------------------------
def test_percentile_interpolates_and_skips_nan() -> None:
    assert lr.percentile([1.0, 2.0, 3.0, 4.0, math.nan], 50) == 2.5
    assert lr.percentile([10.0], 95) == 10.0
    assert math.isnan(lr.percentile([], 50))


def _router(ttft: list[float], tokens: int, slot: dict[str, int]) -> dict[str, object]:
    outcomes = [lr.Outcome(i % 3, t, tokens) for i, t in enumerate(ttft)]
    outcomes.append(lr.Outcome(0, math.nan, 0, "HTTP 503"))
    events = {"slot": Counter(slot), "disk": Counter({k: v // 2 for k, v in slot.items()})}
    return lr.summarize(outcomes, 10.0, events, 3)


def test_summarize_counts_loads_per_1000_successful_requests() -> None:
    r = _router([100.0] * 40, 16, {"1": 6, "2": 4})
    assert r["requests"] == 40 and r["failed"] == 1 and r["errors"] == ["HTTP 503"]
    assert r["slot_loads"] == 10 and r["slot_loads_per_1k"] == 250.0
    assert r["disk_loads_per_1k"] == 125.0
    assert r["slot_loads_per_engine"] == [6, 4]
    assert r["output_tok_s"] == 64.0  # 40 x 16 tokens over 10 s
    assert r["requests_per_adapter"] == [14, 13, 13]


@pytest.mark.parametrize(("aware_ttft", "aware_slot", "ttft_verdict", "loads_verdict"), [
    (50.0, {"1": 2}, "MET", "MET"),
    (90.0, {"1": 8}, "MISSED", "MISSED"),
])
def test_report_table_and_verdicts(aware_ttft: float, aware_slot: dict[str, int], ttft_verdict: str,
                                   loads_verdict: str) -> None:
    ns = lr.parse_args([])
    doc = {"command": "python -m loadtests.bench.lora_routing", "timestamp": "x",
           "params": {**vars(ns), "per_word_tokens": 1.2},
           "routers": {lr.AWARE: _router([aware_ttft] * 40, 16, aware_slot),
                       lr.DEFAULT: _router([100.0] * 40, 16, {"1": 10, "2": 10})},
           "decisions": {"affinity": 30, "new": 3, "spill": 7}}
    md = lr.markdown(doc)
    assert "REAL vLLM CPU engines" in md and "Activating LoRA" in md
    rows = [line for line in md.splitlines() if line.startswith("| ") and "Router" not in line
            and "---" not in line]
    assert len(rows) == 2 and rows[0].startswith(f"| {lr.LABELS[lr.AWARE]} | 40 | 1 |")
    assert "| 500 | 250 | 10 / 10 |" in rows[1]  # default: 20 slot loads over 40 requests
    assert f"target <= 0.6x: {ttft_verdict}" in md
    assert f"target <= 0.25x: {loads_verdict}" in md
    assert "decisions: affinity 30, new 3, spill 7" in md


def test_parse_args_defaults_match_the_issue() -> None:
    ns = lr.parse_args([])
    assert (ns.adapters, ns.replicas, ns.max_loras, ns.zipf_s) == (16, 2, 4, 1.1)
    assert isinstance(ns, argparse.Namespace) and ns.users * ns.duration <= 8 * 90


def test_a_streamed_answer_gives_ttft_text_and_usage() -> None:
    """loadtests.bench.affinity.stream_chat, the reader both benches use, over a canned stream."""
    import httpx

    from loadtests.bench.affinity import stream_chat

    events = [{"choices": [{"delta": {"role": "assistant"}}]},
              {"choices": [{"delta": {"content": "Ahoy"}}]},
              {"choices": [{"delta": {"content": " there"}}]},
              {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}]
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=sse) if request.headers["authorization"] == "Bearer k" \
            else httpx.Response(401, text="no")

    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        ttft, text, usage = stream_chat(client, "http://x/v1", {"model": "m"}, {"Authorization": "Bearer k"})
        assert ttft >= 0 and text == "Ahoy there" and usage["completion_tokens"] == 2
        ttft, tokens = lr.one_request(client, "http://x/v1", "k", "m", "hi", 4)
        assert ttft >= 0 and tokens == 2
        with pytest.raises(RuntimeError, match="m: HTTP 401"):
            stream_chat(client, "http://x/v1", {"model": "m"}, {"Authorization": "Bearer nope"})
