"""The fault handling's own logic, without Ray: the outage hold, the engine watchdog, the log flush
level, the local redis and the classification of what a client saw."""

from __future__ import annotations

import asyncio
import logging
import logging.handlers
import shutil
import socket
import time
from pathlib import Path

import pytest

from loadtests.harness.faults import Result, classify, recovery
from serve_app.engine.watchdog import EngineWatchdog
from serve_app.gateway.outage import ModelDown, OutageGuard
from serve_app.gateway.routing.replicas import LiveReplicas, Status
from serve_app.runtime import logflush


# ---- outage hold ------------------------------------------------------------------------------
def _live(running: dict[str, int], refresh_s: float = 0.05) -> LiveReplicas:
    live = LiveReplicas(lambda: Status(dict(running)), refresh_s)
    live.refresh()
    return live


def test_a_request_to_a_model_with_no_running_replica_is_held_then_refused() -> None:
    async def main() -> float:
        guard = OutageGuard(0.3, _live({"m": 0}))
        never: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        t0 = time.monotonic()
        with pytest.raises(ModelDown):
            await guard.first("m", never, t0)
        assert never.cancelled()
        return time.monotonic() - t0

    took = asyncio.run(main())
    # Held for the whole hold (a wall-clock fact: asyncio waits real time), then refused rather
    # than left hanging; the upper bound only has to tell "refused" from "hung" on a busy machine.
    assert 0.3 <= took < 2.0


def test_a_slow_answer_from_a_healthy_model_is_never_cut() -> None:
    async def main() -> int:
        guard = OutageGuard(0.05, _live({"m": 1}, refresh_s=0.02))

        async def slow() -> int:
            await asyncio.sleep(0.4)
            return 7

        return await guard.first("m", slow(), time.monotonic())

    assert asyncio.run(main()) == 7


def test_a_failure_seen_by_the_gateway_counts_until_an_answer_clears_it() -> None:
    async def main() -> None:
        guard = OutageGuard(0.1, _live({"m": 1}))
        guard.saw_failure("m")
        never: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        with pytest.raises(ModelDown):
            await guard.first("m", never, time.monotonic())

        async def quick() -> int:
            return 1

        assert await guard.first("m", quick(), time.monotonic()) == 1  # an answer clears it
        assert not guard.is_down("m")

    asyncio.run(main())


def test_an_unknown_count_is_no_evidence_of_an_outage() -> None:
    def broken() -> Status:
        raise RuntimeError("controller busy")

    live = LiveReplicas(broken, 0.05)
    live.refresh()
    assert OutageGuard(0.1, live).is_down("m") is False


# ---- watchdog ---------------------------------------------------------------------------------
class FakeEngine:
    errored = False


def test_the_watchdog_sees_a_dead_engine_fails_health_plainly_and_exits_after_the_grace() -> None:
    exits: list[float] = []
    engine = FakeEngine()

    async def main() -> tuple[float, float]:
        dog = EngineWatchdog(engine, "m", poll_s=0.01, grace_s=0.2,
                             exit_process=lambda: exits.append(time.monotonic()))
        dog.start()
        dog.check_health()  # alive: no error
        await asyncio.sleep(0.05)
        assert not exits
        t0 = time.monotonic()
        engine.errored = True
        assert dog.dead  # seen at once by a request, not only by the poller
        with pytest.raises(RuntimeError) as info:
            dog.check_health()
        # Plain and small: no exception chain for Ray Serve's controller to keep.
        assert info.value.__cause__ is None and info.value.__context__ is None
        assert str(info.value) == "engine of m is dead"
        await asyncio.sleep(0.4)
        dog.stop()
        return t0, exits[0]

    t0, exited = asyncio.run(main())
    assert len(exits) == 1
    assert 0.15 <= exited - t0 < 0.4


def test_an_engine_that_raises_on_errored_counts_as_dead() -> None:
    class Broken:
        @property
        def errored(self) -> bool:
            raise AttributeError("torn down")

    assert EngineWatchdog(Broken(), "m", exit_process=lambda: None).dead


# ---- log flush --------------------------------------------------------------------------------
def test_warnings_reach_the_file_at_once_while_info_stays_buffered(tmp_path: Path) -> None:
    log = logging.getLogger("faults-test-logger")
    target = logging.FileHandler(tmp_path / "replica.log")
    buffered = logging.handlers.MemoryHandler(1000, flushLevel=logging.ERROR, target=target)
    log.addHandler(buffered)
    log.setLevel(logging.INFO)
    try:
        assert logflush.install(names=["faults-test-logger"]) == 1
        log.info("routine")
        assert (tmp_path / "replica.log").read_text() == ""
        log.warning("model m unavailable")
        text = (tmp_path / "replica.log").read_text()
        assert "routine" in text and "model m unavailable" in text
        log.info("later")
        logflush.flush_all(names=["faults-test-logger"])
        assert "later" in (tmp_path / "replica.log").read_text()
    finally:
        log.removeHandler(buffered)
        buffered.close()
        target.close()


# ---- local redis ------------------------------------------------------------------------------
def _redis_cmd(port: int, *args: str) -> bytes:
    payload = f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(payload.encode())
        return s.recv(1024)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_the_local_redis_keeps_counters_across_a_restart(tmp_path: Path) -> None:
    from serve_app.local.redis_server import start_local_redis

    state = tmp_path / "state"
    first = start_local_redis(state)
    try:
        assert first.url.startswith("redis://127.0.0.1:")
        assert _redis_cmd(first.port, "INCRBY", "usage:k:requests", "41") == b":41\r\n"
    finally:
        first.stop()  # redis writes its append-only file on a clean stop
    second = start_local_redis(state)
    try:
        assert _redis_cmd(second.port, "INCR", "usage:k:requests") == b":42\r\n"
    finally:
        second.stop()


def test_a_missing_redis_server_is_a_clear_error(tmp_path: Path) -> None:
    from serve_app.local.redis_server import LocalStateError, start_local_redis

    with pytest.raises(LocalStateError, match="did not start"):
        start_local_redis(tmp_path / "s", timeout_s=1, exe="/bin/false")


# ---- what a client saw ------------------------------------------------------------------------
@pytest.mark.parametrize(("facts", "kind"), [
    ({"status": 200, "retry_after": None, "finished": True}, "completed"),
    ({"status": 200, "retry_after": None, "error_event": True}, "error_event"),
    ({"status": 503, "retry_after": "2"}, "unavailable"),
    ({"status": 429, "retry_after": "1"}, "rate_limited"),
    ({"status": 503, "retry_after": None}, "no_retry_after"),
    ({"status": 500, "retry_after": None}, "bad_status"),
    ({"status": 200, "retry_after": None}, "cut"),  # ended without finish_reason
    ({"status": 200, "retry_after": None, "finished": True, "connection_error": True}, "cut"),
])
def test_classify(facts: dict, kind: str) -> None:
    assert classify(facts.pop("status"), facts.pop("retry_after"), **facts) == kind


def test_recovery_times() -> None:
    rs = [Result("completed", 9.0, 9.1), Result("completed", 10.1, 10.2),
          Result("unavailable", 10.3, 10.4), Result("unavailable", 11, 16),
          Result("completed", 70, 70.5)]
    assert recovery(rs, kill_at=10.0) == (pytest.approx(0.4), pytest.approx(60.5))
    assert recovery(rs[:2], kill_at=10.0) == (None, None)


# ---- soak -------------------------------------------------------------------------------------
def test_the_soak_reads_streams_as_a_client_would() -> None:
    from loadtests.soak import parse_sse

    ok = [b'data: {"choices":[{"delta":{"content":"a"}}]}', b"",
          b'data: {"choices":[{"finish_reason":"length"}]}',
          b'data: {"choices":[],"usage":{"completion_tokens":12}}', b"data: [DONE]"]
    assert parse_sse(ok) == (True, False, True, 12)
    broken = [b'data: {"choices":[{"delta":{"content":"a"}}]}',
              b'data: {"error":{"message":"m","type":"server_error","code":"service_unavailable"}}',
              b"data: [DONE]"]
    assert parse_sse(broken) == (False, True, True, 0)
    assert parse_sse([b'data: {"choices":[{"delta":{"content":"a"}}]}']) == (False, False, False, 0)


def test_the_soak_rules() -> None:
    from loadtests.soak import check

    tier = {"sent": 10, "kinds": {"completed": 8, "error_event": 1, "unavailable": 1},
            "tokens_completed": 800, "usage_requests": 10, "usage_completion_tokens": 850,
            "examples": []}
    assert check({"kills": 1, "tiers": {"premium": tier}}, max_tokens=100) == []
    cut = {**tier, "kinds": {**tier["kinds"], "cut": 1}}
    assert "cut" in check({"kills": 1, "tiers": {"premium": cut}}, 100)[0]
    lost = {**tier, "usage_requests": 0}
    assert "usage counted 0 requests" in check({"kills": 1, "tiers": {"p": lost}}, 100)[0]
    assert check({"kills": 0, "tiers": {}}, 100) == ["no replica was killed"]


# ---- drain ------------------------------------------------------------------------------------
def test_the_drain_lets_streams_finish_then_stops_the_rest() -> None:
    from serve_app.gateway.admission.drain import Drain

    status = {"deleting": False}
    live = LiveReplicas(lambda: Status({}, status["deleting"]), 0.02)
    cancelled: list[str] = []

    async def main() -> None:
        drain = Drain(0.3, live)
        quick = drain.track(lambda: cancelled.append("quick"))
        slow = drain.track(lambda: cancelled.append("slow"))
        await asyncio.sleep(0.1)
        assert not drain.draining
        status["deleting"] = True
        live.refresh()  # the thread's next reading
        await asyncio.sleep(0.1)
        assert drain.draining
        drain.done(quick)  # finished in time
        await asyncio.sleep(0.35)
        assert slow.stopped and not quick.stopped
        assert cancelled == ["slow"]
        late = drain.track(lambda: cancelled.append("late"))  # after the deadline: at once
        assert late.stopped

    asyncio.run(main())


def test_the_drain_counts_from_when_the_deletion_was_seen() -> None:
    """The deadline runs from the status reading, not from when a stream next looks at it."""
    from serve_app.gateway.admission.drain import Drain

    live = LiveReplicas(lambda: Status({}, True), 10.0)
    live.refresh()
    live.deleting_since = time.monotonic() - 5.0  # seen 5 s ago

    async def main() -> bool:
        drain = Drain(1.0, live)
        return drain.track(lambda: None).stopped

    assert asyncio.run(main())


def test_replica_titles_match_one_deployment_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    import loadtests.harness.faults as faults

    titles = {1: "ray::ServeReplica:llm:model-tiny-chat-b", 2: "ray::ServeReplica:llm:model-tiny-chat",
              3: "ray::ServeReplica:llm:model-tiny-chat.handle_request_streaming", 4: "python x"}
    monkeypatch.setattr(faults, "descendants", lambda root: dict.fromkeys(titles, 0))
    monkeypatch.setattr(faults, "_title", lambda pid: titles[pid])
    assert faults.find_replicas(0, "model-tiny-chat") == [2, 3]
    assert faults.find_replicas(0, "model-tiny-chat-b") == [1]
