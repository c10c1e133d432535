"""What the gateway and a model replica agree on: the endpoint table and what crosses a handle.

``ENDPOINTS`` is the one table of the model endpoints. The gateway's routes are made from it and
the model replica dispatches with it, so adding an endpoint is one row here (plus its route when it
needs more than the generic one).

Only plain data crosses a deployment handle: a JSON-serialisable ``RequestContext`` goes down with
the parsed body, and the model answers with a stream of

1. a ``Head`` (status, whether a stream follows, the first bytes; for a complete answer its tokens),
2. for a stream, ``Chunk`` tuples: SSE bytes already serialised in the model replica (relayed as
   they are) and the completion tokens the engine has generated so far,
3. for a stream, a ``Trailer`` with the exact token counts, however the stream ended in the replica.

A stream that the gateway stops early (the client went away) is charged the count of the last chunk
it received: the engine's own count, never an estimate from the number of events.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypedDict

SSE_DONE = b"data: [DONE]\n\n"

Task = Literal["generate", "embed"]


@dataclass(frozen=True)
class Endpoint:
    """One API endpoint that a model deployment serves through vLLM's own serving layer."""

    name: str  # the key in ENDPOINTS, sent to the model replica with each request
    path: str  # the gateway's HTTP path (POST)
    task: Task  # the model task that serves it
    main_param: str  # the main input field, named by context-length errors
    request_type: str  # vLLM's request type, "module:Name" (resolved in engine/, never here)
    serving: str  # the attribute of vLLM's ``init_app_state`` state that serves it
    handler: str  # that serving object's method ("__call__" for a callable)
    dialect: Literal["openai", "anthropic"] = "openai"  # the shape of its error bodies


ENDPOINTS: dict[str, Endpoint] = {
    e.name: e
    for e in (
        Endpoint(
            "chat", "/v1/chat/completions", "generate", "messages",
            "vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest",
            "openai_serving_chat", "create_chat_completion",
        ),
        Endpoint(
            "completions", "/v1/completions", "generate", "prompt",
            "vllm.entrypoints.openai.completion.protocol:CompletionRequest",
            "openai_serving_completion", "create_completion",
        ),
        Endpoint(
            "embeddings", "/v1/embeddings", "embed", "input",
            "vllm.entrypoints.pooling.embed.protocol:EmbeddingRequest",
            "serving_embedding", "__call__",
        ),
    )
}


@dataclass(frozen=True)
class RequestContext:
    """Per-request facts the gateway decided; travels to the model replica as a dict."""

    request_id: str
    key_id: str
    tier: str
    priority: int = 0
    deadline: float = 0.0  # epoch seconds; 0 means none
    tenant: str = ""  # keys of one tenant share vLLM's prefix cache; others cannot probe it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestContext:
        return cls(**d)

    def remaining_s(self, default: float) -> float:
        if not self.deadline:
            return default
        return max(0.001, self.deadline - time.time())


class Tokens(TypedDict):
    """Token counts of one request, as the engine counted them."""

    prompt_tokens: int
    completion_tokens: int


class Head(TypedDict):
    """The first item of every model answer."""

    status: int
    stream: bool  # Chunks and a Trailer follow
    body: bytes  # a complete answer, or the stream's first SSE bytes
    # A complete answer's usage (None for an error); for a stream, the counts at its first bytes.
    tokens: Tokens | None


class Trailer(TypedDict):
    """The last item of a stream: its exact token counts, for accounting (never relayed)."""

    tokens: Tokens


# SSE bytes and the completion tokens the engine has generated for the request so far.
Chunk = tuple[bytes, int]


def head(status: int, body: bytes, *, stream: bool = False, tokens: Tokens | None = None) -> Head:
    return {"status": status, "stream": stream, "body": body, "tokens": tokens}


def trailer(prompt_tokens: int, completion_tokens: int) -> Trailer:
    return {"tokens": tokens_of(prompt_tokens, completion_tokens)}


def tokens_of(prompt_tokens: int, completion_tokens: int) -> Tokens:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}


def usage_tokens(usage: Any) -> Tokens | None:
    """The token counts of an OpenAI ``usage`` object (a dict), or None if it has none."""
    if not isinstance(usage, dict):
        return None
    return tokens_of(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))


def sse_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"
