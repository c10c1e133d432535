"""What the gateway and a model replica agree on: the endpoint table and what crosses a handle.

``ENDPOINTS`` is the one table of the model endpoints. The gateway's routes are made from it and
the model replica dispatches with it, so adding an endpoint is one row here (plus its route when it
needs more than the generic one).

Only plain data crosses a deployment handle: a JSON-serialisable ``RequestContext`` goes down with
the parsed body, and the model answers with a stream of

1. a ``Head`` (status, whether a stream follows, the first bytes; for a complete answer its tokens),
2. for a complete answer larger than ``PART_BYTES``, ``Head.parts`` more ``bytes`` items: the rest
   of the body (``split_complete``). The link between deployments carries one message of at most
   4 MiB by default (gRPC in throughput mode); a 1,024-input embedding answer is larger,
3. for a stream, ``Chunk`` tuples: SSE bytes already serialised in the model replica (relayed as
   they are) and the completion tokens the engine has generated so far,
4. for a stream, a ``Trailer`` with the exact token counts, however the stream ended in the replica.

A stream that the gateway stops early (the client went away) is charged the count of the last chunk
it received: the engine's own count, never an estimate from the number of events.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypedDict

from serve_app import errors

SSE_DONE = b"data: [DONE]\n\n"
# A complete answer travels in parts of at most this many bytes (gRPC's default limit is 4 MiB).
PART_BYTES = 1024 * 1024

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
        # OpenAI's Responses API (Codex). Stateless: its route refuses server-side state.
        Endpoint(
            "responses", "/v1/responses", "generate", "input",
            "vllm.entrypoints.openai.responses.protocol:ResponsesRequest",
            "openai_serving_responses", "create_responses",
        ),
        # Anthropic's Messages API (Claude Code), errors in Anthropic's envelope.
        Endpoint(
            "messages", "/v1/messages", "generate", "messages",
            "vllm.entrypoints.anthropic.protocol:AnthropicMessagesRequest",
            "anthropic_serving_messages", "create_messages", dialect="anthropic",
        ),
        Endpoint(
            "count_tokens", "/v1/messages/count_tokens", "generate", "messages",
            "vllm.entrypoints.anthropic.protocol:AnthropicCountTokensRequest",
            "anthropic_serving_messages", "count_tokens", dialect="anthropic",
        ),
        # What `vllm serve` also has: tokenizer round trips, and scoring on embedding models.
        Endpoint(
            "tokenize", "/tokenize", "generate", "prompt",
            "vllm.entrypoints.serve.tokenize.protocol:TokenizeRequest",
            "serving_tokenization", "create_tokenize",
        ),
        Endpoint(
            "detokenize", "/detokenize", "generate", "tokens",
            "vllm.entrypoints.serve.tokenize.protocol:DetokenizeRequest",
            "serving_tokenization", "create_detokenize",
        ),
        Endpoint(
            "score", "/v1/score", "embed", "text_1",
            "vllm.entrypoints.pooling.scoring.protocol:ScoreRequest",
            "serving_scores", "__call__",
        ),
        Endpoint(
            "rerank", "/v1/rerank", "embed", "documents",
            "vllm.entrypoints.pooling.scoring.protocol:RerankRequest",
            "serving_scores", "__call__",
        ),
    )
}
ANTHROPIC_PATHS = frozenset(e.path for e in ENDPOINTS.values() if e.dialect == "anthropic")


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
    parts: int  # a complete answer's further body parts (bytes items) that follow the head


class Trailer(TypedDict):
    """The last item of a stream: its exact token counts, for accounting (never relayed)."""

    tokens: Tokens


# SSE bytes and the completion tokens the engine has generated for the request so far.
Chunk = tuple[bytes, int]


def head(status: int, body: bytes, *, stream: bool = False, tokens: Tokens | None = None,
         parts: int = 0) -> Head:
    return {"status": status, "stream": stream, "body": body, "tokens": tokens, "parts": parts}


def split_complete(status: int, body: bytes, tokens: Tokens | None = None,
                   part_bytes: int = PART_BYTES) -> list[Head | bytes]:
    """A complete answer as a head and, when ``body`` is larger than ``part_bytes``, the rest of
    it in parts (``Head.parts`` says how many follow), each small enough for one message."""
    view = memoryview(body)
    rest = [bytes(view[i:i + part_bytes]) for i in range(part_bytes, len(body), part_bytes)]
    first: Head = head(status, bytes(view[:part_bytes]), tokens=tokens, parts=len(rest))
    return [first, *rest]


def trailer(prompt_tokens: int, completion_tokens: int) -> Trailer:
    return {"tokens": tokens_of(prompt_tokens, completion_tokens)}


def tokens_of(prompt_tokens: int, completion_tokens: int) -> Tokens:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}


def usage_tokens(usage: Any) -> Tokens | None:
    """The token counts of a ``usage`` object (a dict; OpenAI's prompt/completion names, or the
    Responses and Anthropic APIs' input/output names), or None if it has none."""
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    return tokens_of(int(prompt or 0), int(completion or 0))


def render_error(endpoint: Endpoint | None, exc: errors.ServeAppError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) of an error in the endpoint's dialect (OpenAI's when None)."""
    if endpoint is not None and endpoint.dialect == "anthropic":
        return errors.anthropic_error(exc)
    return exc.status, exc.to_body(), dict(exc.headers)


def stream_error(endpoint: Endpoint | None, exc: errors.ServeAppError) -> bytes:
    """The event that ends a stream that already started, in the endpoint's own stream format:
    Anthropic's ``error`` event, the Responses API's ``error`` event, or OpenAI's chat/completions
    ``data: {"error": ...}`` followed by ``[DONE]``."""
    if endpoint is not None and endpoint.dialect == "anthropic":
        return errors.anthropic_sse_error(exc)
    if endpoint is not None and endpoint.name == "responses":
        event = {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    return sse_event(json.dumps(exc.to_body()).encode()) + SSE_DONE


def sse_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"
