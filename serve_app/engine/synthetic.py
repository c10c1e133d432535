"""A SYNTHETIC upstream: a model deployment that streams made-up tokens at a set rate, no engine.

For sizing the gateway (``loadtests.bench.gateway``): with ``synthetic: {tokens_per_s, ttft_ms}`` in
a model's config, its replica loads no weights and runs no vLLM. Each request waits ``ttft_ms``,
sends its first token at once, then the tokens that are due every ``stream_interval_ms`` (as the
real replica's pacing does) until ``max_tokens``. Every answer says it is synthetic: its ``id``
starts with ``synthetic-``, ``system_fingerprint`` is ``serve-app-synthetic`` and the text is the
word ``synthetic`` repeated; the replica logs a warning at start-up. It is a ``backend.Backend``
as ``server.EngineServer`` is (a ``Head``, chunks, a trailer), so the gateway cannot tell them apart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from serve_app.config import ModelConfig
from serve_app.engine.backend import Answer, Diagnostics
from serve_app.engine.madeup import MadeUp, wants_usage
from serve_app.protocol import (
    SSE_DONE,
    Endpoint,
    Head,
    RequestContext,
    Trailer,
    head,
    tokens_of,
    trailer,
)

logger = logging.getLogger(__name__)

FINGERPRINT = "serve-app-synthetic"
TOKEN_TEXT = "synthetic "


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """About 4 characters a token, as no tokenizer is loaded."""
    if "messages" in body:
        text = "".join(str(m.get("content", "")) for m in body.get("messages") or [] if isinstance(m, dict))
    else:
        text = str(body.get("prompt", ""))
    return max(1, len(text) // 4)


class SyntheticServer:
    """A ``Backend`` that stands in for ``EngineServer``: made-up tokens at ``tokens_per_s`` each."""

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.synthetic is None:
            raise ValueError(f"model {cfg.id!r} has no synthetic settings")
        self.cfg = cfg
        self.tokens_per_s = cfg.synthetic.tokens_per_s
        self.ttft_s = cfg.synthetic.ttft_ms / 1000.0
        self.interval_s = cfg.stream_interval_ms / 1000.0
        self.answers = MadeUp(cfg.id, "synthetic upstream", "synthetic-", FINGERPRINT, TOKEN_TEXT)
        self.streamed_tokens = 0
        self._running = 0

    async def start(self) -> None:
        logger.warning(
            "SYNTHETIC upstream for %s: no engine; %.0f tokens/s per stream, TTFT %.0f ms",
            self.cfg.id, self.tokens_per_s, self.ttft_s * 1000,
        )

    async def check_health(self) -> None:
        return None

    def diagnostics(self) -> Diagnostics:
        # No engine: nothing waits for a slot, and nothing can die.
        return {"unfinished_requests": self._running, "waiting_for_slot": 0,
                "streamed_tokens": self.streamed_tokens, "engine_dead": False}

    def shutdown(self) -> None:
        return None

    async def handle(
        self, endpoint: Endpoint, body: dict[str, Any], ctx: RequestContext
    ) -> AsyncIterator[Answer]:
        max_tokens = self.answers.max_tokens(endpoint, body)
        if not isinstance(max_tokens, int):
            yield max_tokens
            return
        prompt = estimate_prompt_tokens(body)
        self._running += 1
        try:
            if body.get("stream") is True:
                async for item in self._stream(endpoint, body, max_tokens, prompt):
                    yield item
            else:
                await asyncio.sleep(self.ttft_s + (max_tokens - 1) / self.tokens_per_s)
                yield head(200, self.answers.complete(endpoint, max_tokens, prompt),
                           tokens=tokens_of(prompt, max_tokens))
        finally:
            self._running -= 1

    async def _stream(self, endpoint: Endpoint, body: dict[str, Any], max_tokens: int,
                      prompt: int) -> AsyncIterator[Head | tuple[bytes, int] | Trailer]:
        base = self.answers.base(endpoint)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        sent = 0
        try:
            await asyncio.sleep(self.ttft_s)
            sent = 1
            data = self.answers.chunk(endpoint, base, 1, True, "length" if max_tokens == 1 else None)
            yield head(200, data, stream=True, tokens=tokens_of(prompt, sent))
            while sent < max_tokens:
                await asyncio.sleep(max(self.interval_s, 1.0 / self.tokens_per_s))
                due = 1 + int((loop.time() - t0 - self.ttft_s) * self.tokens_per_s)
                n = max(1, min(max_tokens, due) - sent)
                sent += n
                yield self.answers.chunk(endpoint, base, n, False, "length" if sent >= max_tokens else None), sent
            tail = self.answers.usage_chunk(endpoint, base, prompt, sent) if wants_usage(body) else b""
            yield tail + SSE_DONE, sent
            yield trailer(prompt, sent)
        finally:
            self.streamed_tokens += sent
