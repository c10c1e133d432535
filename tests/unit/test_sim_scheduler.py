"""serve_app.engine.sim: vLLM's scheduling semantics (batching, chunked prefill, prefix cache,
LRU eviction, priority, preemption) and the step-time model, without Ray or wall-clock waits."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest

from serve_app.engine.sim.blocks import BlockPool, chain_hashes
from serve_app.engine.sim.engine import SimEngine
from serve_app.engine.sim.profile import PROFILES_FILE, StepWork, load_profile, prefill_pairs
from serve_app.engine.sim.scheduler import Batch, Limits, Policy, Scheduler, SimRequest, Status
from serve_app.engine.sim.tokens import chat_text, text_ids
from tests.unit.sim_fakes import FakeClock, Steps


def ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def sched(num_blocks: int = 1000, seqs: int = 256, budget: int = 8192, policy: Policy = "fcfs",
          block_size: int = 16) -> Scheduler:
    return Scheduler(Limits(seqs, budget, policy), BlockPool(num_blocks, block_size))


def req(name: str, prompt: list[int], max_tokens: int = 4, priority: int = 0, salt: str = "",
        arrival: float = 0.0) -> SimRequest:
    return SimRequest(name, prompt, max_tokens, priority, salt, arrival)


def run_to_end(s: Scheduler, check: Callable[[Batch], None] = lambda b: None,
               limit: int = 10_000) -> list[Batch]:
    """Step ``s`` (a modelled second each) until nothing is left; ``check`` sees each batch
    before it runs."""
    batches = []
    t = 0.0
    while (s.running or s.num_waiting) and len(batches) < limit:
        b = s.schedule()
        check(b)
        t += 1.0
        s.complete(b, t)
        batches.append(b)
    return batches


def step_tokens(b: Batch) -> dict[str, int]:
    return {x.request.id: x.new for x in b.scheduled}


def test_a_step_holds_at_most_max_num_seqs_requests() -> None:
    s = sched(seqs=2)
    for i in range(5):
        s.add(req(f"r{i}", ids(20, 100 * i)))
    first = s.schedule()
    assert list(step_tokens(first)) == ["r0", "r1"] and s.num_waiting == 3
    s.complete(first, 1.0)
    assert len(s.schedule().scheduled) == 2  # still two: the others wait for a seat
    batches = run_to_end(s)
    assert all(len(b.scheduled) <= 2 for b in batches)


def test_the_token_budget_bounds_a_step_and_a_long_prompt_is_prefilled_in_chunks() -> None:
    s = sched(budget=100)
    a, b = req("a", ids(250), max_tokens=2), req("b", ids(30, 1000), max_tokens=2)
    s.add(a)
    s.add(b)
    batches = run_to_end(s)
    assert all(batch.work().tokens <= 100 for batch in batches)
    steps = [step_tokens(batch) for batch in batches]
    # a's prefill spans three steps (100, 100, 50); b gets no room until a's chunks leave some.
    assert [st.get("a") for st in steps[:3]] == [100, 100, 50]
    assert steps[0] == {"a": 100}
    assert a.first_token_at == 3.0 and len(a.outputs) == 2 and len(b.outputs) == 2
    assert s.prompt_tokens == 280 and s.generation_tokens == 4


def test_a_repeated_prompt_hits_the_prefix_cache_and_another_tenant_does_not() -> None:
    s = sched()
    prompt = ids(100)  # 6 full blocks of 16, and 4 tokens more
    first = req("a", prompt, salt="tenant-1")
    s.add(first)
    run_to_end(s)
    assert first.cached_tokens == 0
    again = req("b", prompt, salt="tenant-1")
    s.add(again)
    batch = s.schedule()
    assert again.cached_tokens == 96 and step_tokens(batch) == {"b": 4}
    run_to_end(s)
    other = req("c", prompt, salt="tenant-2")
    s.add(other)
    run_to_end(s)
    assert other.cached_tokens == 0
    assert s.pool.stats.queries == 300 and s.pool.stats.hits == 96


def test_at_least_one_token_is_computed_even_when_every_block_is_cached() -> None:
    s = sched()
    s.add(req("a", ids(64)))
    run_to_end(s)
    again = req("b", ids(64))
    s.add(again)
    assert step_tokens(s.schedule()) == {"b": 16} and again.cached_tokens == 48


def test_block_hashes_chain_so_a_shared_middle_does_not_hit() -> None:
    x = chain_hashes(ids(32), 16)
    y = chain_hashes(ids(16, 500) + ids(16, 16), 16)  # second block's tokens equal x's second
    assert x[1] != y[1]
    assert chain_hashes(ids(32), 16, "salt")[1] != x[1]  # the salt of block 0 reaches every block
    assert chain_hashes(ids(32), 16) == x


def test_free_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    s = sched(num_blocks=8)
    a, b = req("a", ids(48, 0), max_tokens=1), req("b", ids(48, 1000), max_tokens=1)
    s.add(a)
    run_to_end(s)  # a held 3 blocks, all cached and free now
    s.add(b)
    run_to_end(s)  # b used 3 of the 5 never-used blocks
    assert s.pool.num_free == 8 and len(s.pool.cached) == 6
    c = req("c", ids(64, 5000), max_tokens=1)  # 4 blocks: 2 never used, then a's 2 oldest
    s.add(c)
    run_to_end(s)
    # a freed its blocks last-first, so its prefix stays longest: its first block survives.
    assert s.pool.stats.evicted_blocks == 2
    assert len(s.pool.longest_hit(a.hashes, 48)) == 1  # a's two tail blocks went
    assert len(s.pool.longest_hit(b.hashes, 48)) == 3  # b, freed later, is whole


def test_the_priority_policy_takes_lower_values_first_then_arrival() -> None:
    s = sched(seqs=1, policy="priority")
    for name, prio, t in (("late-low", 5, 0.0), ("high-2", 0, 2.0), ("high-1", 0, 1.0)):
        s.add(req(name, ids(8, hash(name) % 1000), max_tokens=1, priority=prio, arrival=t))
    order = []
    for b in run_to_end(s):
        order.extend(x.request.id for x in b.scheduled if x.request.id not in order)
    assert order == ["high-1", "high-2", "late-low"]
    f = sched(seqs=1)
    for name, prio in (("first", 5), ("second", 0)):
        f.add(req(name, ids(8), max_tokens=1, priority=prio))
    assert [x.request.id for x in f.schedule().scheduled] == ["first"]  # fcfs ignores priority


def test_running_out_of_blocks_preempts_the_lowest_priority_request_which_recomputes() -> None:
    s = sched(num_blocks=4, policy="priority")
    low = req("low", ids(16, 0), max_tokens=20, priority=9, arrival=0.0)
    high = req("high", ids(16, 100), max_tokens=20, priority=0, arrival=1.0)
    s.add(low)
    s.add(high)

    def fits(b: Batch) -> None:
        assert sum(len(r.blocks) for r in s.running) <= 4

    preempted = [r.id for b in run_to_end(s, fits) for r in b.preempted]
    assert preempted and set(preempted) == {"low"}
    assert low.num_preemptions >= 1 and high.num_preemptions == 0
    assert high.finished_at is not None and low.finished_at is not None
    assert high.finished_at < low.finished_at
    assert len(low.outputs) == 20 and len(high.outputs) == 20  # the preempted one still finishes
    assert s.pool.num_free == 4


def test_under_fcfs_the_latest_running_request_is_preempted() -> None:
    s = sched(num_blocks=4)
    first, second = req("first", ids(16, 0), max_tokens=20), req("second", ids(16, 100), max_tokens=20)
    s.add(first)
    s.add(second)
    preempted = {r.id for b in run_to_end(s) for r in b.preempted}
    assert preempted == {"second"}
    assert first.done and second.done and first.status is Status.FINISHED


def test_an_aborted_request_frees_its_blocks() -> None:
    s = sched(num_blocks=10)
    r = req("r", ids(40), max_tokens=50)
    s.add(r)
    s.complete(s.schedule(), 1.0)
    assert s.pool.num_free == 7
    s.abort(r)
    assert r.status is Status.ABORTED and s.pool.num_free == 10 and not s.running


def test_a_cached_prompts_ttft_is_shorter_by_the_profiles_ratio() -> None:
    profile = load_profile("h100-llama3.1-8b-analytic")
    assert not profile.fitted and "ANALYTIC" in profile.source

    async def ttft(engine: SimEngine, prompt: list[int]) -> float:
        r = req(f"r{len(engine.scheduler.running)}-{engine.steps}", prompt, max_tokens=1)
        engine.submit(r)
        await engine.wait(r, 0)
        assert r.first_token_at is not None
        return r.first_token_at - r.arrival

    async def main() -> tuple[float, float]:
        engine = SimEngine(sched(num_blocks=4096), profile, FakeClock(), Steps())
        engine.start()
        cold = await ttft(engine, ids(2048))
        await ttft(engine, ids(1024, 50_000) + ids(1024, 90_000))  # caches the first half
        warm = await ttft(engine, ids(1024, 50_000) + ids(1024, 70_000))
        engine.stop()
        return cold, warm

    cold, warm = asyncio.run(main())
    assert cold == pytest.approx(0.0435, rel=0.01)  # issue 39: 43.5 ms for 2,048 tokens on an H100
    assert warm == pytest.approx(0.0231, rel=0.01)  # 23.1 ms with half of it cached
    assert warm / cold == pytest.approx(23.1 / 43.5, rel=0.01)


def test_the_engine_reports_each_step_for_the_metrics() -> None:
    async def main() -> Steps:
        steps = Steps()
        engine = SimEngine(sched(), load_profile("cpu-tiny"), FakeClock(), steps)
        engine.start()
        reqs = [req(f"r{i}", ids(40), max_tokens=3) for i in range(2)]
        for r in reqs:
            engine.submit(r)
        for r in reqs:
            await engine.wait(r, 2)
        engine.stop()
        return steps

    reports = asyncio.run(main()).reports
    assert sum(r.generation_tokens for r in reports) == 6
    assert sum(r.prompt_tokens for r in reports) == 80
    assert sum(len(r.ttfts) for r in reports) == 2 and sum(len(r.itls) for r in reports) == 4
    assert sum(r.cache_queries for r in reports) == 80
    assert [len(r.finished) for r in reports][-1] == 2 and reports[-1].running == 0


def test_text_gives_stable_token_ids_and_a_chat_keeps_its_prefix_as_it_grows() -> None:
    assert text_ids("abcdefgh") == text_ids("abcdefgh") and len(text_ids("abcdefgh")) == 2
    turn1 = [{"role": "user", "content": "x" * 400}]
    turn2 = [*turn1, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    one, two = text_ids(chat_text(turn1)), text_ids(chat_text(turn2))
    assert two[:len(one) - 4] == one[:-4]  # all but the assistant marker's tokens


@pytest.mark.parametrize("name", ["h100-llama3.1-8b", "h100-llama3.1-8b-tp2", "h200-llama3.1-8b",
                                  "h200-llama3.1-8b-tp2", "h100-llama3.1-70b-tp4"])
def test_a_fitted_gpu_profile_reproduces_aiconfigurators_own_figures(name: str) -> None:
    profile = load_profile(name)
    assert profile.fitted and "aiconfigurator-core 0.12.0" in profile.source
    ref = json.loads(PROFILES_FILE.read_text())["profiles"][name]["fit"]["reference_ms"]
    ours = {
        "prefill_2048": StepWork(2048, prefill_pairs(2048, 0)),
        "prefill_2048_half_cached": StepWork(1024, prefill_pairs(1024, 1024)),
        "decode_bs1_ctx2048": StepWork(decode_seqs=1, decode_context=2049),
        "decode_bs64_ctx2048": StepWork(decode_seqs=64, decode_context=64 * 2049),
    }
    for key, work in ours.items():
        assert profile.step_s(work) * 1000 == pytest.approx(ref[key], rel=0.15), key
