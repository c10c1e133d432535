"""Behaviour across the deployment boundary: disconnects abort engine work; the gateway stays light."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_client_disconnect_aborts_engine_request(stack, serve_handles) -> None:
    engine = serve_handles("model-tiny-chat")

    def unfinished() -> int:
        return engine.stats.remote().result(timeout_s=30)["unfinished_requests"]

    unfinished()  # warm the handle: its first call waits for the replica list
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 2000, "stream": True, "ignore_eos": True}
    missed = []
    # 2000 tokens take the tiny model about 10 s alone, and the stats call can itself take
    # seconds on a loaded machine (the replica is busy streaming). An attempt where the engine
    # answered late proves nothing either way, so try again.
    for _ in range(3):
        start = time.monotonic()
        with httpx.stream("POST", f"{stack.base_url}/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {stack.keys['all']}"}) as r:
            assert r.status_code == 200
            chunks = r.iter_bytes()
            seen = next(chunks) + next(chunks)
            t0 = time.monotonic()
            running = unfinished()
            asked = time.monotonic() - t0
            if running == 0:
                rest = b"".join(chunks)
                missed.append(f"the engine took {asked:.1f} s to answer; the stream "
                              f"{'had ended with [DONE]' if rest.rstrip().endswith(b'[DONE]') else 'broke'}"
                              f" ({len(seen) + len(rest)} bytes): ...{rest[-200:]!r}")
                continue
            if time.monotonic() - start > 3:
                missed.append(f"engine answered {time.monotonic() - start:.1f} s into the stream: "
                              "too late to tell an abort from the end")
                continue
        break  # the connection is closed while the engine runs the request
    else:
        pytest.fail("the engine never held the request mid-stream:\n" + "\n".join(missed))
    # Disconnected within 3 s of the start: the request must leave the engine by abort, well
    # before it could finish.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if unfinished() == 0:
            return
        time.sleep(0.2)
    pytest.fail("the engine still runs the request after the client disconnected")


def _through_every_gateway_replica(stack) -> None:
    """Concurrent requests: HAProxy balances by least connections, so each gateway replica forwards
    at least one (a replica reports its transport once it has forwarded a request)."""
    async def send() -> None:
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as c:
            rs = await asyncio.gather(*(c.post("/chat/completions", json=body, headers={
                "Authorization": f"Bearer {stack.keys['all']}"}) for _ in range(6)))
        assert [r.status_code for r in rs] == [200] * 6

    asyncio.run(send())


def test_gateway_replica_never_imports_the_engine(stack, serve_handles) -> None:
    _through_every_gateway_replica(stack)
    diag = serve_handles("gateway").diagnostics.remote().result(timeout_s=10)
    assert diag["heavy_modules"] == []
    # Requests go to the model replicas' own endpoints (routing.direct), not over Serve handles.
    assert diag["model_transport"] == "direct"
    print(f"\n[stack] gateway peak RSS: {diag['peak_rss_bytes'] / 2**20:.0f} MiB")


def test_diagnose_reports_the_gateway_and_each_model_replica(stack) -> None:
    _through_every_gateway_replica(stack)
    out = subprocess.run([sys.executable, "-m", "serve_app.cli", "diagnose"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    assert lines["app llm"].startswith("RUNNING")
    assert json.loads(lines["gateway"])["model_transport"] == "direct"
    tiny = json.loads(lines["model-tiny-chat"])
    assert tiny["model"] == "tiny-chat" and tiny["waiting_for_slot"] == 0
    assert json.loads(lines["model-minilm-embed"])["unfinished_requests"] == 0


def test_cut_short_stream_is_charged_the_tokens_the_engine_made(stack, serve_handles) -> None:
    """A paced stream carries several tokens per event. The client reads a few events (vLLM's
    continuous usage stats say how many tokens they held) and goes away: /v1/usage is charged at
    least those tokens and no more than the engine made for the request, not one per event."""
    engine = serve_handles("model-tiny-chat")
    auth = {"Authorization": f"Bearer {stack.keys['all']}"}

    def stats() -> dict:
        return engine.stats.remote().result(timeout_s=30)

    def usage() -> dict:
        return httpx.get(f"{stack.base_url}/usage", headers=auth, timeout=30).json()

    made_before, used_before = stats()["streamed_tokens"], usage()
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 2000, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events: list[dict] = []
    with httpx.stream("POST", f"{stack.base_url}/chat/completions", json=body, timeout=60,
                      headers=auth) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line.removeprefix("data: ")))
                if len(events) >= 6 and events[-1]["usage"]["completion_tokens"] >= 20:
                    break
    seen = events[-1]["usage"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        used = usage()
        if used["requests"] > used_before["requests"] and stats()["unfinished_requests"] == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the cut-short request was not recorded")
    charged = used["completion_tokens"] - used_before["completion_tokens"]
    made = stats()["streamed_tokens"] - made_before
    print(f"\n[ledger] client read {len(events)} events holding {seen['completion_tokens']} tokens; "
          f"charged {charged}; the engine made {made}")
    assert used["prompt_tokens"] - used_before["prompt_tokens"] == seen["prompt_tokens"]
    assert seen["completion_tokens"] <= charged <= made < 2000
