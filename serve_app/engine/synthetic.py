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
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from serve_app import errors
from serve_app.config import ModelConfig
from serve_app.engine.adapter import error_head
from serve_app.engine.backend import Answer, Diagnostics
from serve_app.protocol import (
    SSE_DONE,
    Endpoint,
    Head,
    RequestContext,
    Trailer,
    head,
    requested_max_tokens,
    sse_event,
    tokens_of,
    trailer,
)

logger = logging.getLogger(__name__)

FINGERPRINT = "serve-app-synthetic"
TOKEN_TEXT = "synthetic "
DEFAULT_MAX_TOKENS = 16


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
        if not endpoint.stream_options:
            yield error_head(errors.InvalidRequest(
                f"model {self.cfg.id!r} is a synthetic upstream and serves only "
                "/v1/chat/completions and /v1/completions", param="model"), endpoint)
            return
        field, max_tokens = requested_max_tokens(body, endpoint.max_tokens_fields)
        max_tokens = max_tokens or DEFAULT_MAX_TOKENS
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            yield error_head(errors.InvalidRequest(f"{field} must be a positive integer",
                                                   param=field), endpoint)
            return
        prompt = estimate_prompt_tokens(body)
        self._running += 1
        try:
            if body.get("stream") is True:
                async for item in self._stream(endpoint, body, max_tokens, prompt):
                    yield item
            else:
                await asyncio.sleep(self.ttft_s + (max_tokens - 1) / self.tokens_per_s)
                yield head(200, json.dumps(self._complete(endpoint, max_tokens, prompt)).encode(),
                           tokens=tokens_of(prompt, max_tokens))
        finally:
            self._running -= 1

    # ---- answers -----------------------------------------------------------------------------
    def _base(self, endpoint: Endpoint, rid: str, created: int) -> dict[str, Any]:
        kind = "chat.completion" if endpoint.name == "chat" else "text_completion"
        return {"id": rid, "object": kind, "created": created, "model": self.cfg.id,
                "system_fingerprint": FINGERPRINT}

    def _complete(self, endpoint: Endpoint, n: int, prompt: int) -> dict[str, Any]:
        doc = self._base(endpoint, f"synthetic-{uuid.uuid4().hex}", int(time.time()))
        text = TOKEN_TEXT * n
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if endpoint.name == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        doc["choices"] = [choice]
        doc["usage"] = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
        return doc

    def _chunk(self, endpoint: Endpoint, base: dict[str, Any], n: int, first: bool,
               finish: str | None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if endpoint.name == "chat":
            delta: dict[str, Any] = {"content": TOKEN_TEXT * n}
            if first:
                delta["role"] = "assistant"
            choice["delta"] = delta
        else:
            choice["text"] = TOKEN_TEXT * n
        return sse_event(json.dumps({**base, "object": base["object"] + ".chunk" if endpoint.name
                                     == "chat" else base["object"], "choices": [choice]}).encode())

    async def _stream(self, endpoint: Endpoint, body: dict[str, Any], max_tokens: int,
                      prompt: int) -> AsyncIterator[Head | tuple[bytes, int] | Trailer]:
        base = self._base(endpoint, f"synthetic-{uuid.uuid4().hex}", int(time.time()))
        opts = body.get("stream_options")
        wants_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        sent = 0
        try:
            await asyncio.sleep(self.ttft_s)
            sent = 1
            data = self._chunk(endpoint, base, 1, True, "length" if max_tokens == 1 else None)
            yield head(200, data, stream=True, tokens=tokens_of(prompt, sent))
            while sent < max_tokens:
                await asyncio.sleep(max(self.interval_s, 1.0 / self.tokens_per_s))
                due = 1 + int((loop.time() - t0 - self.ttft_s) * self.tokens_per_s)
                n = max(1, min(max_tokens, due) - sent)
                sent += n
                yield self._chunk(endpoint, base, n, False, "length" if sent >= max_tokens else None), sent
            tail = b""
            if wants_usage:
                usage = {"prompt_tokens": prompt, "completion_tokens": sent, "total_tokens": prompt + sent}
                tail = sse_event(json.dumps({**base, "object": base["object"] + ".chunk"
                                             if endpoint.name == "chat" else base["object"],
                                             "choices": [], "usage": usage}).encode())
            yield tail + SSE_DONE, sent
            yield trailer(prompt, sent)
        finally:
            self.streamed_tokens += sent
