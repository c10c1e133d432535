"""serve_app.engine.synthetic: the engine-less upstream that the gateway benchmark streams from."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from pydantic import ValidationError

from serve_app.engine.synthetic import FINGERPRINT, SyntheticServer
from serve_app.protocol import ENDPOINTS, SSE_DONE, RequestContext
from tests.unit.builders import app_config, model

CTX = RequestContext(request_id="r1", key_id="k", tier="standard")
SYNTHETIC = {"tokens_per_s": 200, "ttft_ms": 30}


async def _collect(server: SyntheticServer, endpoint: str, body: dict[str, Any]) -> tuple[list[Any], float]:
    t0 = time.monotonic()
    first_at = 0.0
    items = []
    async for item in server.handle(ENDPOINTS[endpoint], body, CTX):
        if not items:
            first_at = time.monotonic() - t0
        items.append(item)
    return items, first_at


def _events(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in data.decode().split("\n\n")
            if line.startswith("data: {")]


def test_a_stream_waits_ttft_then_sends_every_token_labelled_synthetic() -> None:
    server = SyntheticServer(model(synthetic=SYNTHETIC, stream_interval_ms=20))
    body = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 24, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    items, first_at = asyncio.run(_collect(server, "chat", body))
    took = time.monotonic() - t0
    head, *chunks, trailer = items
    assert head["status"] == 200 and head["stream"] is True
    assert 0.025 <= first_at < 0.5  # ttft_ms 30
    # 23 more tokens at 200/s take about 115 ms after the first.
    assert 0.12 <= took < 1.5
    data = head["body"] + b"".join(c[0] for c in chunks)
    assert data.endswith(SSE_DONE)
    events = _events(data)
    assert all(e["system_fingerprint"] == FINGERPRINT and e["id"].startswith("synthetic-") for e in events)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == "synthetic " * 24
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 24, "total_tokens": 34}
    # Tokens are coalesced per interval, as the real replica's pacing does: fewer events than tokens.
    assert 2 <= len(chunks) < 24
    assert [c[1] for c in chunks] == sorted(c[1] for c in chunks) and chunks[-1][1] == 24
    assert trailer == {"tokens": {"prompt_tokens": 10, "completion_tokens": 24}}
    assert server.diagnostics() == {"unfinished_requests": 0, "waiting_for_slot": 0,
                                    "streamed_tokens": 24, "engine_dead": False}


def test_without_include_usage_the_stream_has_no_usage_chunk() -> None:
    server = SyntheticServer(model(synthetic=SYNTHETIC, stream_interval_ms=0))
    items, _ = asyncio.run(_collect(server, "completions", {"prompt": "hi", "max_tokens": 3, "stream": True}))
    data = items[0]["body"] + b"".join(c[0] for c in items[1:-1])
    events = _events(data)
    assert "".join(e["choices"][0]["text"] for e in events) == "synthetic " * 3
    assert all("usage" not in e for e in events)


def test_a_complete_answer_carries_usage() -> None:
    server = SyntheticServer(model(synthetic=SYNTHETIC))
    [head], _ = asyncio.run(_collect(server, "chat", {"messages": [], "max_tokens": 5}))
    doc = json.loads(head["body"])
    assert doc["choices"][0]["message"]["content"] == "synthetic " * 5
    assert doc["system_fingerprint"] == FINGERPRINT
    assert head["tokens"] == {"prompt_tokens": 1, "completion_tokens": 5}


def test_other_endpoints_and_bad_max_tokens_are_openai_errors() -> None:
    server = SyntheticServer(model(synthetic=SYNTHETIC))
    [head], _ = asyncio.run(_collect(server, "embeddings", {"input": "x"}))
    assert head["status"] == 400 and json.loads(head["body"])["error"]["param"] == "model"
    [head], _ = asyncio.run(_collect(server, "chat", {"messages": [], "max_tokens": -1}))
    assert head["status"] == 400 and json.loads(head["body"])["error"]["param"] == "max_tokens"


def test_config_is_strict_and_needs_a_generate_model() -> None:
    m = model(synthetic=SYNTHETIC)
    assert m.synthetic is not None and m.synthetic.tokens_per_s == 200
    with pytest.raises(ValidationError, match="tokens_per_s"):
        model(synthetic={"tokens_per_s": 0})
    with pytest.raises(ValidationError, match="extra"):
        model(synthetic={"tokens_per_s": 10, "burst": 3})
    with pytest.raises(ValidationError, match="synthetic needs task 'generate'"):
        model(synthetic=SYNTHETIC, task="embed")
    app_config(m.model_dump(mode="json"))
    assert model().synthetic is None
