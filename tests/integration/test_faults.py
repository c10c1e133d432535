"""Process kills under streaming load, through the real front door with the real openai SDK.

Each test kills one process of the session stack while 4 clients stream and a prober sends small
requests back to back, then asserts what the clients saw: every request completed, or ended with
an error event and ``[DONE]``, or got 503/429 with ``Retry-After`` (none hung, none got a 500), and
how long the outage lasted. They run after every other test (marker ``faults``; the ordering hook
is in tests/conftest.py), since the stack needs about a minute to replace a model replica.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from loadtests.harness.faults import (
    OK_KINDS,
    Prober,
    StreamLoad,
    alive,
    find_controller,
    find_engine_core,
    find_replicas,
    loaded_libraries,
    recovery,
    rss_mb,
    summary,
)

pytestmark = [pytest.mark.integration, pytest.mark.faults]

MODEL = "tiny-chat"
DEPLOYMENT = "model-tiny-chat"
HOLD_S = 5.0  # gateway.http.unavailable_hold_s's default
RECOVERY_BOUND_S = 150.0


def _usage(stack) -> dict:
    r = httpx.get(f"{stack.base_url}/usage", timeout=30,
                  headers={"Authorization": f"Bearer {stack.keys['all']}"})
    assert r.status_code == 200, r.text
    return r.json()


def _wait_healthy(stack, timeout_s: float = 240.0) -> None:
    """The model answers again (after an earlier kill), and its replica process is found."""
    deadline = time.monotonic() + timeout_s
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    while time.monotonic() < deadline:
        try:
            r = httpx.post(f"{stack.base_url}/chat/completions", json=body, timeout=30,
                           headers={"Authorization": f"Bearer {stack.keys['all']}"})
            if r.status_code == 200 and find_replicas(stack.proc.pid, DEPLOYMENT):
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"{MODEL} did not answer within {timeout_s:.0f} s")


def _under_load(stack, kill, *, settle_s: float = 3.0, until_recovered: bool = True):
    """Stream, kill, wait for recovery; returns (stream results, probe results, kill time)."""
    _wait_healthy(stack)
    key = stack.keys["all"]
    load = StreamLoad(stack.base_url, key, MODEL, workers=4, max_tokens=300).start()
    probe = Prober(stack.base_url, key, MODEL, interval_s=0.2).start()
    try:
        time.sleep(settle_s)
        kill_at = time.monotonic()
        kill()
        if until_recovered:
            failed = probe.wait_for(lambda r: r.kind != "completed", kill_at, 30)
            if failed is not None:
                probe.wait_for(lambda r: r.kind == "completed", failed.ended, RECOVERY_BOUND_S)
        time.sleep(2.0)
    finally:
        probes = probe.stop()
        streams = load.stop()
    return streams, probes, kill_at


def _report(name: str, streams, probes, kill_at: float) -> tuple[float | None, float | None]:
    first_503, recovered = recovery(probes, kill_at)
    held = [r.duration for r in probes if r.started >= kill_at and r.kind == "unavailable"]
    print(f"\n[faults] {name}: streams {summary(streams)}; probes {summary(probes)}; "
          f"first clean 503 {first_503 if first_503 is None else round(first_503, 2)} s; "
          f"recovered {recovered if recovered is None else round(recovered, 1)} s; "
          f"longest 503 wait {max(held, default=0):.2f} s")
    return first_503, recovered


def _assert_clean(streams, probes, kill_at: float) -> None:
    bad = [r for r in [*streams, *probes] if r.kind not in OK_KINDS]
    assert not bad, f"{len(bad)} requests failed badly: " + "; ".join(
        f"{r.kind} {r.status} {r.detail}" for r in bad[:5])
    # A 503 comes within the hold (plus slack for a busy machine), never after a long hang.
    slow = [r for r in probes if r.kind == "unavailable" and r.duration > HOLD_S + 3]
    assert not slow, f"503s after {[round(r.duration, 1) for r in slow]} s (hold {HOLD_S} s)"
    assert any(r.kind == "completed" and r.started > kill_at for r in probes), "never recovered"


def test_engine_core_death_answers_503_at_once_and_recovers(stack) -> None:
    _wait_healthy(stack)
    controller = find_controller(stack.proc.pid)
    before_mb = rss_mb(controller) if controller else 0.0
    replica = find_replicas(stack.proc.pid, DEPLOYMENT)[0]
    engine = find_engine_core(replica)
    assert engine is not None, "no VLLM::EngineCore process under the model replica"

    streams, probes, kill_at = _under_load(stack, lambda: os.kill(engine, signal.SIGKILL))
    first_503, recovered = _report("engine SIGKILL", streams, probes, kill_at)
    _assert_clean(streams, probes, kill_at)
    # The engine's death is seen within 0.1 s; its replica answers 503 until it exits (0.5 s).
    assert first_503 is not None and first_503 < 1.5, first_503
    assert recovered is not None and recovered < RECOVERY_BOUND_S
    assert not alive(replica), "the replica with a dead engine is still running"
    cut_with_event = [r for r in streams if r.kind == "error_event"]
    assert cut_with_event, f"no stream was in flight at the kill: {summary(streams)}"
    if controller:
        time.sleep(1.0)
        after_mb = rss_mb(controller)
        print(f"[faults] Serve controller RSS {before_mb:.0f} -> {after_mb:.0f} MB; libraries "
              f"loaded {loaded_libraries(controller)}")
        assert after_mb - before_mb < 200, (before_mb, after_mb)


def test_model_replica_death_holds_then_503s(stack) -> None:
    _wait_healthy(stack)
    replica = find_replicas(stack.proc.pid, DEPLOYMENT)[0]
    streams, probes, kill_at = _under_load(stack, lambda: os.kill(replica, signal.SIGKILL))
    first_503, recovered = _report("model replica SIGKILL", streams, probes, kill_at)
    _assert_clean(streams, probes, kill_at)
    assert first_503 is not None and first_503 < HOLD_S + 6, first_503
    assert recovered is not None and recovered < RECOVERY_BOUND_S


def test_gateway_death_keeps_usage_and_the_other_replica_serves(stack) -> None:
    _wait_healthy(stack)
    gateways = find_replicas(stack.proc.pid, "gateway")
    assert len(gateways) >= 2, f"the session stack runs 2 gateway replicas, found {gateways}"
    before = _usage(stack)
    streams, probes, kill_at = _under_load(
        stack, lambda: os.kill(gateways[0], signal.SIGKILL), until_recovered=False, settle_s=3.0)
    _report("gateway SIGKILL", streams, probes, kill_at)
    # Streams held by the killed gateway are cut: nothing in that process can still write to
    # them (README, Troubleshooting). Every other request is answered properly.
    cut = [r for r in streams if r.kind == "cut"]
    in_flight = [r for r in cut if r.started < kill_at < r.ended]
    assert len(cut) == len(in_flight) <= 4, f"cut streams not in flight at the kill: {cut}"
    late = [r for r in [*streams, *probes] if r.started > kill_at + 1.0]
    assert late and all(r.kind in OK_KINDS for r in late), summary(late)
    assert sum(r.kind == "completed" for r in late) >= len(late) // 2, summary(late)
    after = _usage(stack)
    counted = sum(r.kind == "completed" for r in [*streams, *probes])
    print(f"[faults] usage requests {before['requests']} -> {after['requests']} "
          f"(client counted {counted} completed meanwhile)")
    assert after["requests"] >= before["requests"] + counted, (before, after, counted)
    assert after["completion_tokens"] > before["completion_tokens"]


@pytest.mark.stops_stack
def test_ctrl_c_lets_streams_finish_or_ends_them_with_an_error_event(stack) -> None:
    """Ctrl-C of `serve-app run` (SIGINT to its process group, as a terminal sends it) while
    streams run: short ones finish, long ones end with an error event and [DONE] once
    gateway.http.drain_timeout_s (10 s) has passed; none is cut. This stops the session stack."""
    import openai

    from loadtests.harness.faults import stream_once
    from loadtests.harness.stack import _signal_group

    _wait_healthy(stack)
    results = []
    lock = threading.Lock()

    def one(max_tokens: int) -> None:
        client = openai.OpenAI(base_url=stack.base_url, api_key=stack.keys["all"], max_retries=0,
                               timeout=90)
        r = stream_once(client, MODEL, max_tokens)
        with lock:
            results.append((max_tokens, r))

    threads = [threading.Thread(target=one, args=(n,)) for n in (100, 100, 20000, 20000)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    signalled = time.monotonic()
    _signal_group(stack.proc, signal.SIGINT)
    for t in threads:
        t.join(90)
    for n, r in sorted(results, key=lambda x: x[0]):
        print(f"[faults] Ctrl-C: max_tokens {n}: {r.kind} {r.ended - signalled:+.1f} s after "
              f"the signal {r.detail[:80]}")
    assert len(results) == 4
    assert all(r.kind in ("completed", "error_event") for _, r in results), results
    assert all(r.ended - signalled < 10 + 8 for _, r in results), results
    stack.proc.popen.wait(120)
