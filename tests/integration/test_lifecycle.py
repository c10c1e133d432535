"""Behaviour across the deployment boundary: disconnects abort engine work; the gateway stays light."""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.integration


def test_client_disconnect_aborts_engine_request(stack, serve_handles) -> None:
    engine = serve_handles("model-tiny-chat")
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{stack.base_url}/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {stack.keys['all']}"}) as r:
        assert r.status_code == 200
        chunks = r.iter_bytes()
        seen = next(chunks) + next(chunks)
        running = engine.stats.remote().result(timeout_s=10)["unfinished_requests"]
        assert running >= 1, f"the engine holds no request mid-stream; the stream so far: {seen!r}"
    # The connection is closed now. 2000 tokens take the tiny model well over 5 s on these CPUs
    # (about 20 s), so the request must leave the engine by abort, not by finishing.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if engine.stats.remote().result(timeout_s=10)["unfinished_requests"] == 0:
            return
        time.sleep(0.2)
    pytest.fail("the engine still runs the request after the client disconnected")


def test_gateway_replica_never_imports_the_engine(serve_handles) -> None:
    diag = serve_handles("gateway").diagnostics.remote().result(timeout_s=10)
    assert diag["heavy_modules"] == []
    # serve-app run keeps Ray's object-reference transport between deployments on purpose (see
    # serve_app/ingress.py: with throughput mode's gRPC, max_queued_requests did not always shed).
    assert diag["model_transport"] == "object refs"
    print(f"\n[stack] gateway peak RSS: {diag['peak_rss_bytes'] / 2**20:.0f} MiB")
