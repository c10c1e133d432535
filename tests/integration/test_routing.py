"""Routing beyond one id per model: a weighted split of one public name, and a fallback model."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

pytestmark = pytest.mark.integration


def _chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def test_weighted_split_serves_from_both_versions(stack) -> None:
    served = Counter()
    for _ in range(40):
        r = httpx.post(f"{stack.base_url}/chat/completions", json=_chat("tiny-ab"), timeout=60,
                       headers={"Authorization": f"Bearer {stack.keys['all']}"})
        assert r.status_code == 200
        served[r.headers["x-served-by"]] += 1
    # 50/50 weights: each side gets at least 8 of 40 unless something is badly wrong (p < 1e-4).
    assert set(served) == {"tiny-chat", "tiny-chat-b"} and min(served.values()) >= 8, served


def test_fallback_answers_when_the_primary_queue_is_full(stack) -> None:
    async def one(c: httpx.AsyncClient) -> httpx.Response:
        body = _chat("tiny-chat-b", max_tokens=200, stream=True, ignore_eos=True)
        async with c.stream("POST", "/chat/completions", json=body) as r:
            await r.aread()
            return r

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120,
                                     headers={"Authorization": f"Bearer {stack.keys['all']}"}) as c:
            return await asyncio.gather(*[one(c) for _ in range(6)])

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 6
    served = Counter(r.headers["x-served-by"] for r in responses)
    # tiny-chat-b holds one running and one queued request; the rest overflow onto tiny-chat.
    assert served["tiny-chat"] >= 1 and served["tiny-chat-b"] >= 1, served
    assert all(r.text.rstrip().endswith("data: [DONE]") for r in responses)
