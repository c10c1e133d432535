"""serve_app.engine.sim.server: the simulated engine as a Backend (Head, chunks, Trailer with exact
counts, cached_tokens on a prefix hit, labelled simulated), and its config and placement."""

from __future__ import annotations

import asyncio
import json
import typing
from typing import Any

import pytest
from pydantic import ValidationError

from serve_app.config.engine import SimProfile
from serve_app.engine.placement import placement_options
from serve_app.engine.sim.profile import profile_names
from serve_app.engine.sim.server import FINGERPRINT, SimServer
from serve_app.engine.sim.tokens import chat_text, text_ids
from serve_app.protocol import ENDPOINTS, SSE_DONE, RequestContext
from tests.unit.builders import app_config, model
from tests.unit.sim_fakes import FakeClock, Steps

SIM = {"profile": "h100-llama3.1-8b-analytic", "num_blocks": 512}
LONG = "word " * 400  # 2,000 characters: 500 tokens and more with the chat template


def ctx(tenant: str = "t1", rid: str = "r1", priority: int = 0) -> RequestContext:
    return RequestContext(request_id=rid, key_id="k", tier="standard", tenant=tenant, priority=priority)


def server(**over: Any) -> tuple[SimServer, Steps]:
    steps = Steps()
    over.setdefault("simulated", SIM)
    return SimServer(model(stream_interval_ms=0, **over), FakeClock(), steps), steps


async def collect(srv: SimServer, endpoint: str, body: dict[str, Any], c: RequestContext) -> list[Any]:
    return [item async for item in srv.handle(ENDPOINTS[endpoint], body, c)]


def run(srv: SimServer, *calls: tuple[str, dict[str, Any], RequestContext]) -> list[list[Any]]:
    async def main() -> list[list[Any]]:
        await srv.start()
        out = [await collect(srv, *call) for call in calls]
        srv.shutdown()
        return out
    return asyncio.run(main())


def events(items: list[Any]) -> list[dict[str, Any]]:
    data = items[0]["body"] + b"".join(c[0] for c in items[1:-1])
    assert data.endswith(SSE_DONE)
    return [json.loads(line[6:]) for line in data.decode().split("\n\n") if line.startswith("data: {")]


def chat(content: str, max_tokens: int = 12, stream: bool = True) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream, "stream_options": {"include_usage": True}}


def test_a_stream_is_a_head_chunks_and_a_trailer_with_exact_counts_labelled_simulated() -> None:
    srv, steps = server()
    [items] = run(srv, ("chat", chat(LONG), ctx()))
    head, *chunks, trailer = items
    prompt = len(text_ids(chat_text([{"role": "user", "content": LONG}])))
    assert head["status"] == 200 and head["stream"] is True
    assert head["tokens"] == {"prompt_tokens": prompt, "completion_tokens": 1}
    assert [c[1] for c in chunks] == sorted(c[1] for c in chunks) and chunks[-1][1] == 12
    assert trailer == {"tokens": {"prompt_tokens": prompt, "completion_tokens": 12}}
    evs = events(items)
    assert all(e["id"].startswith("sim-") and e["system_fingerprint"] == FINGERPRINT for e in evs)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in evs if e["choices"]) \
        == "simulated " * 12
    assert evs[-1]["usage"] == {"prompt_tokens": prompt, "completion_tokens": 12,
                                "total_tokens": prompt + 12}  # nothing cached: no details
    assert srv.diagnostics() == {"unfinished_requests": 0, "waiting_for_slot": 0,
                                 "streamed_tokens": 12, "engine_dead": False}
    assert sum(r.generation_tokens for r in steps.reports) == 12


def test_a_repeated_prompt_reports_cached_tokens_but_not_to_another_tenant() -> None:
    srv, _ = server()
    first, again, other = run(srv, ("chat", chat(LONG), ctx("t1")), ("chat", chat(LONG), ctx("t1", "r2")),
                              ("chat", chat(LONG), ctx("t2", "r3")))
    prompt = first[-1]["tokens"]["prompt_tokens"]
    cached = events(again)[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt - 1) // 16 * 16 and cached > 0
    assert "prompt_tokens_details" not in events(other)[-1]["usage"]
    assert srv.engine.scheduler.pool.stats.hits == cached


def test_a_complete_answer_carries_usage_and_the_text_completion_shape() -> None:
    srv, _ = server()
    [[head]] = run(srv, ("completions", {"prompt": "hello there", "max_tokens": 5}, ctx()))
    doc = json.loads(head["body"])
    assert doc["object"] == "text_completion" and doc["choices"][0]["text"] == "simulated " * 5
    assert doc["id"].startswith("sim-") and doc["system_fingerprint"] == FINGERPRINT
    assert head["tokens"] == {"prompt_tokens": 3, "completion_tokens": 5}
    assert doc["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


def test_other_endpoints_and_too_long_requests_are_openai_errors() -> None:
    srv, _ = server(engine={"max_model_len": 100})
    (emb,), (long,), (big,) = run(
        srv, ("embeddings", {"input": "x"}, ctx()),
        ("completions", {"prompt": "x" * 400, "max_tokens": 5}, ctx()),
        ("completions", {"prompt": "x", "max_tokens": -1}, ctx()))
    assert emb["status"] == 400 and json.loads(emb["body"])["error"]["param"] == "model"
    err = json.loads(long["body"])["error"]
    assert long["status"] == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert big["status"] == 400 and json.loads(big["body"])["error"]["param"] == "max_tokens"
    small, _ = server(simulated={**SIM, "num_blocks": 4})  # 64 tokens of KV cache
    [[head]] = run(small, ("completions", {"prompt": "x" * 400, "max_tokens": 5}, ctx()))
    assert head["status"] == 400 and "KV cache" in json.loads(head["body"])["error"]["message"]


def test_a_waiting_higher_priority_request_takes_the_next_free_seat() -> None:
    srv, _ = server(engine={"max_num_seqs": 1, "scheduling_policy": "priority"})
    done: list[str] = []

    async def one(rid: str, priority: int, n: int = 3) -> None:
        await collect(srv, "chat", chat(rid * 50, n, stream=False), ctx(rid=rid, priority=priority))
        done.append(rid)

    async def main() -> None:
        await srv.start()
        low = asyncio.create_task(one("l", 5, 100))
        while not srv.engine.scheduler.running:
            await asyncio.sleep(0)  # low holds the only seat
        await asyncio.gather(low, one("m", 3), one("h", 0))
        srv.shutdown()

    asyncio.run(main())
    assert done == ["l", "h", "m"]
    assert srv.engine.scheduler.generation_tokens == 106


def test_config_is_strict_exclusive_and_names_the_field() -> None:
    m = model(simulated=SIM)
    assert m.simulated is not None and m.simulated.time_scale == 1.0
    with pytest.raises(ValidationError, match="simulated and synthetic are exclusive"):
        model(simulated=SIM, synthetic={"tokens_per_s": 10})
    with pytest.raises(ValidationError, match="simulated needs task 'generate'"):
        model(simulated=SIM, task="embed")
    with pytest.raises(ValidationError, match=r"engine.kv_cache_memory_bytes \(1000\)"):
        model(simulated=SIM, engine={"kv_cache_memory_bytes": 1000})
    with pytest.raises(ValidationError, match="profile"):
        model(simulated={"profile": "b900-nope"})
    with pytest.raises(ValidationError, match="time_scale"):
        model(simulated={**SIM, "time_scale": 0})
    with pytest.raises(ValidationError, match="extra"):
        model(simulated={**SIM, "max_num_seqs": 8})  # the engine's own field holds it
    app_config(m.model_dump(mode="json"))


def test_the_config_knows_exactly_the_shipped_profiles() -> None:
    assert set(typing.get_args(SimProfile)) == set(profile_names())


def test_a_simulated_replica_reserves_no_cpu_and_takes_no_placement_group() -> None:
    opts = placement_options(model(simulated=SIM, accelerator={"kind": "gpu", "type": "H100"}))
    assert opts == {"ray_actor_options": {"num_cpus": 0.0, "num_gpus": 0}}
    real = placement_options(model())
    assert real["ray_actor_options"]["num_cpus"] == 1.0 and real["placement_group_bundles"]
