"""OpenAI-shaped answers of made-up text, for the backends that run no model.

The synthetic upstream (``synthetic.py``) and the simulated engine (``sim/server.py``) answer chat
and text completions with the same bodies, chunks and usage as vLLM does, so the gateway cannot
tell them from a real engine; only their ``id`` prefix, ``system_fingerprint`` and text say what
they are. One copy of those shapes lives here.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from serve_app import errors
from serve_app.engine.adapter import error_head
from serve_app.protocol import Endpoint, Head, requested_max_tokens, sse_event

DEFAULT_MAX_TOKENS = 16


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` only when the prefix hit."""
    doc: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if cached:
        doc["prompt_tokens_details"] = {"cached_tokens": cached}
    return doc


def wants_usage(body: dict[str, Any]) -> bool:
    """Whether a stream's client asked for the usage chunk (``stream_options.include_usage``)."""
    opts = body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))


@dataclass(frozen=True)
class MadeUp:
    """The answers of one model whose text is ``token_text`` repeated, labelled by ``prefix``
    (the ``id``'s start) and ``fingerprint`` (``system_fingerprint``)."""

    model_id: str
    kind: str  # "synthetic upstream", "simulated engine": named in the endpoint error
    prefix: str
    fingerprint: str
    token_text: str

    def max_tokens(self, endpoint: Endpoint, body: dict[str, Any]) -> Head | int:
        """The request's completion bound, or the error head for an endpoint or a bound that
        this backend does not serve."""
        if not endpoint.stream_options:
            return error_head(errors.InvalidRequest(
                f"model {self.model_id!r} is a {self.kind} and serves only "
                "/v1/chat/completions and /v1/completions", param="model"), endpoint)
        field, n = requested_max_tokens(body, endpoint.max_tokens_fields)
        n = n or DEFAULT_MAX_TOKENS
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            return error_head(errors.InvalidRequest(f"{field} must be a positive integer",
                                                    param=field), endpoint)
        return n

    def base(self, endpoint: Endpoint) -> dict[str, Any]:
        """The fields every body and chunk of one answer shares (a new id)."""
        kind = "chat.completion" if endpoint.name == "chat" else "text_completion"
        return {"id": f"{self.prefix}{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": self.model_id, "system_fingerprint": self.fingerprint}

    def complete(self, endpoint: Endpoint, n: int, prompt: int, cached: int = 0) -> bytes:
        """A complete answer of ``n`` tokens to a ``prompt``-token prompt."""
        doc = self.base(endpoint)
        text = self.token_text * n
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if endpoint.name == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        doc["choices"] = [choice]
        doc["usage"] = usage(prompt, n, cached)
        return json.dumps(doc).encode()

    @staticmethod
    def _chunk_object(endpoint: Endpoint, base: dict[str, Any]) -> str:
        return str(base["object"]) + ".chunk" if endpoint.name == "chat" else str(base["object"])

    def chunk(self, endpoint: Endpoint, base: dict[str, Any], n: int, first: bool,
              finish: str | None) -> bytes:
        """One SSE event with ``n`` more tokens (the first carries the chat's role)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if endpoint.name == "chat":
            delta: dict[str, Any] = {"content": self.token_text * n}
            if first:
                delta["role"] = "assistant"
            choice["delta"] = delta
        else:
            choice["text"] = self.token_text * n
        return sse_event(json.dumps({**base, "object": self._chunk_object(endpoint, base),
                                     "choices": [choice]}).encode())

    def usage_chunk(self, endpoint: Endpoint, base: dict[str, Any], prompt: int, n: int,
                    cached: int = 0) -> bytes:
        """The stream's usage event (no choices), as vLLM sends it when asked."""
        return sse_event(json.dumps({**base, "object": self._chunk_object(endpoint, base),
                                     "choices": [], "usage": usage(prompt, n, cached)}).encode())
