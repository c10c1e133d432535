"""Chat, completions and embeddings through the gateway, driven by the official openai SDK."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=stack.keys["all"], max_retries=0)


def test_chat_completion(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "hello"}], max_tokens=12
    )
    assert r.object == "chat.completion"
    assert r.model == "tiny-chat"
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny-chat",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},  # random weights may emit EOS early
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == 16
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_stream_merges_tokens_without_losing_any(client: openai.OpenAI) -> None:
    """Streams read the engine once per stream_interval_ms, so an event carries several tokens;
    the text and the per-token logprobs are exactly those of the same request unstreamed."""
    req = dict(model="tiny-chat", messages=[{"role": "user", "content": "tell a story"}],
               max_tokens=64, temperature=0, logprobs=True, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**req)
    chunks = list(client.chat.completions.create(
        **req, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0] for c in chunks if c.choices]
    text = "".join(d.delta.content or "" for d in deltas)
    logprobs = [lp for d in deltas if d.logprobs and d.logprobs.content for lp in d.logprobs.content]
    assert text == whole.choices[0].message.content
    assert [lp.token for lp in logprobs] == [lp.token for lp in whole.choices[0].logprobs.content]
    assert len(logprobs) == chunks[-1].usage.completion_tokens == 64
    content_events = [d for d in deltas if d.delta.content]
    assert len(content_events) < 64  # tokens were merged (one event per interval, not per token)


def test_stream_wire_format_ends_with_done(stack) -> None:
    with httpx.stream(
        "POST",
        f"{stack.base_url}/chat/completions",
        headers={"Authorization": f"Bearer {stack.keys['all']}"},
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
              "stream": True},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-served-by"] == "tiny-chat"
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_alias_and_n_and_stop_are_vllms(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2
    )
    assert len(r.choices) == 2


def test_text_completion(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny-chat", prompt="The gateway", max_tokens=6)
    assert r.object == "text_completion"
    assert isinstance(r.choices[0].text, str)
    assert r.usage.completion_tokens <= 6


def _cos(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def test_embeddings_are_real(client: openai.OpenAI) -> None:
    r = client.embeddings.create(
        model="minilm-embed",
        input=[
            "A man is playing a guitar on stage.",
            "Someone performs music with a guitar in front of an audience.",
            "The quarterly tax report is due next Friday.",
        ],
    )
    vecs = [d.embedding for d in r.data]
    assert [len(v) for v in vecs] == [384, 384, 384]
    assert _cos(vecs[0], vecs[1]) > _cos(vecs[0], vecs[2]) + 0.2
    assert r.usage.prompt_tokens > 0


def test_models_list_per_key(stack) -> None:
    every = openai.OpenAI(base_url=stack.base_url, api_key=stack.keys["all"])
    ids = {m.id for m in every.models.list()}
    assert ids == {"tiny-chat", "tiny", "tiny-chat-b", "tiny-ab", "tiny-chat-pirate", "minilm-embed", "all-minilm-l6-v2"}
    narrow = openai.OpenAI(base_url=stack.base_url, api_key=stack.keys["embed-only"])
    assert {m.id for m in narrow.models.list()} == {"minilm-embed", "all-minilm-l6-v2"}
    assert narrow.models.retrieve("minilm-embed").id == "minilm-embed"
