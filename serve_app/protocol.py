"""What the gateway and a model replica agree on: the endpoint table and what crosses between them.

``ENDPOINTS`` is the one table of the model endpoints. The gateway's routes are made from it and
the model replica dispatches with it, so adding an endpoint is one row here (plus its route when it
needs more than the generic one).

Only plain data crosses (``serve_app.wire`` frames it): a JSON-serialisable ``RequestContext`` goes
down with the parsed body, and the model answers with a stream of

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
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, NotRequired, Protocol, TypedDict

from serve_app import errors

SSE_DONE = b"data: [DONE]\n\n"
# A complete answer travels in parts of at most this many bytes (gRPC's default limit is 4 MiB).
PART_BYTES = 1024 * 1024

Task = Literal["generate", "embed"]
# Whose API an endpoint speaks: the shape of its error bodies, and which limit headers it sends.
Dialect = Literal["openai", "anthropic"]
BodyCheck = Callable[[dict[str, Any]], None]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _check_stateless(body: dict[str, Any]) -> None:
    """A batch line is answered and never stored (the HTTP route stores responses:
    gateway/responses): refuse what would need a stored response."""
    if body.get("previous_response_id") is not None:
        raise errors.InvalidRequest(
            "previous_response_id is not supported in a batch: a batch line is not stored; send "
            "the whole conversation in 'input'", param="previous_response_id")
    if body.get("background") is True:
        raise errors.InvalidRequest(
            "background: true is not supported in a batch: a batch runs in the background "
            "already", param="background")


@dataclass(frozen=True)
class Endpoint:
    """One API endpoint that a model deployment serves through vLLM's own serving layer.

    Every way endpoints differ is a field here, read by the code that cares; nothing else names
    an endpoint to decide how to treat it."""

    name: str  # the key in ENDPOINTS, sent to the model replica with each request
    path: str  # the gateway's HTTP path (POST)
    task: Task  # the model task that serves it
    main_param: str  # the main input field, named by context-length errors
    request_type: str  # vLLM's request type, "module:Name" (resolved in engine/, never here)
    serving: str  # the attribute of vLLM's ``init_app_state`` state that serves it
    handler: str  # that serving object's method ("__call__" for a callable)
    dialect: Dialect = "openai"
    # The fields that bound the completion, in the order vLLM reads them; a tier's cap is
    # written to the first when the body sets none. Empty: the endpoint generates no text.
    max_tokens_fields: tuple[str, ...] = ()
    # OpenAI's stream_options.include_usage asks for the stream's usage chunk (otherwise vLLM
    # always sends the usage); the synthetic upstream answers these endpoints only.
    stream_options: bool = False
    # A started stream ends on an error with a typed ``event: error`` (the Responses API),
    # instead of OpenAI's ``data: {"error": ...}`` and ``[DONE]``.
    error_event: bool = False
    # model_dump_json options set to True for a complete answer, as vLLM's own router dumps it.
    dump_flags: tuple[str, ...] = ()
    body_check: BodyCheck | None = None  # refuses, in the gateway, a body it cannot serve
    # The gateway stores its answers (OpenAI's stored Responses: gateway/responses) and serves
    # GET/DELETE under the path; its HTTP route is gateway/http/responses.py, not the generic one.
    stored: bool = False
    id_prefix: str = ""  # the engine's request id, which the answer's id is, starts with it
    # OpenTelemetry's gen_ai.operation.name of a call (its trace's model-call span); "" for the
    # endpoints that run no model (tokenize, count_tokens, ...).
    operation: str = ""


ENDPOINTS: dict[str, Endpoint] = {
    e.name: e
    for e in (
        Endpoint(
            "chat", "/v1/chat/completions", "generate", "messages",
            "vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest",
            "openai_serving_chat", "create_chat_completion",
            max_tokens_fields=("max_completion_tokens", "max_tokens"), stream_options=True,
            operation="chat",
        ),
        Endpoint(
            "completions", "/v1/completions", "generate", "prompt",
            "vllm.entrypoints.openai.completion.protocol:CompletionRequest",
            "openai_serving_completion", "create_completion",
            max_tokens_fields=("max_tokens",), stream_options=True, operation="text_completion",
        ),
        Endpoint(
            "embeddings", "/v1/embeddings", "embed", "input",
            "vllm.entrypoints.pooling.embed.protocol:EmbeddingRequest",
            "serving_embedding", "__call__", operation="embeddings",
        ),
        # OpenAI's Responses API (Codex). Stored by the gateway (store, previous_response_id,
        # background); a batch line is not (its body_check).
        Endpoint(
            "responses", "/v1/responses", "generate", "input",
            "vllm.entrypoints.openai.responses.protocol:ResponsesRequest",
            "openai_serving_responses", "create_responses",
            max_tokens_fields=("max_output_tokens",), error_event=True, dump_flags=("by_alias",),
            body_check=_check_stateless, stored=True, id_prefix="resp_", operation="chat",
        ),
        # Anthropic's Messages API (Claude Code), errors in Anthropic's envelope.
        Endpoint(
            "messages", "/v1/messages", "generate", "messages",
            "vllm.entrypoints.anthropic.protocol:AnthropicMessagesRequest",
            "anthropic_serving_messages", "create_messages", dialect="anthropic",
            max_tokens_fields=("max_tokens",), dump_flags=("exclude_none",), operation="chat",
        ),
        Endpoint(
            "count_tokens", "/v1/messages/count_tokens", "generate", "messages",
            "vllm.entrypoints.anthropic.protocol:AnthropicCountTokensRequest",
            "anthropic_serving_messages", "count_tokens", dialect="anthropic",
            dump_flags=("exclude_none",),
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
BY_PATH: dict[str, Endpoint] = {e.path: e for e in ENDPOINTS.values()}
# Every endpoint's completion-bound fields, in the table's order (chat's precedence first), for
# what reads a body without knowing its endpoint.
MAX_TOKENS_FIELDS: tuple[str, ...] = tuple(
    dict.fromkeys(f for e in ENDPOINTS.values() for f in e.max_tokens_fields))


def requested_max_tokens(body: dict[str, Any], fields: Sequence[str]) -> tuple[str | None, Any]:
    """The first of ``fields`` the body sets (not null) and its value; (None, None) if none."""
    for name in fields:
        if body.get(name) is not None:
            return name, body[name]
    return None, None


def number_text(value: float) -> str:
    """A number for an error message, cut to 24 characters (a client may send 10**4000)."""
    text = str(value)
    return text if len(text) <= 24 else text[:24] + "..."


def json_offence(value: Any) -> str | None:
    """What in ``value`` cannot be served: an integer outside 64 bits, NaN/Infinity (not JSON), a
    string with a lone UTF-16 surrogate (it cannot be encoded as UTF-8 later on). Searched
    iteratively, so nesting cannot exhaust the stack. The gateway asks it while parsing a body,
    the model replica again for any caller."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return "strings must not contain lone UTF-16 surrogates (such as \\ud800)"
        elif isinstance(v, bool):
            continue
        elif isinstance(v, int):
            if not INT64_MIN <= v <= INT64_MAX:
                return f"integer {number_text(v)} is out of range (64 bits)"
        elif isinstance(v, float):
            if not math.isfinite(v):
                return "NaN and Infinity are not valid JSON numbers"
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list | tuple):
            todo.extend(v)
    return None


@dataclass(frozen=True)
class RequestContext:
    """Per-request facts the gateway decided; travels to the model replica as a dict."""

    request_id: str
    key_id: str
    tier: str
    priority: int = 0
    deadline: float = 0.0  # epoch seconds; 0 means none
    tenant: str = ""  # keys of one tenant share vLLM's prefix cache; others cannot probe it
    arrival: float = 0.0  # epoch seconds the front door received the request (gateway/timing.py)
    traceparent: str = ""  # W3C trace context: the gateway's span is the replica's parent
    # Tenant plus session (or leading prompt) digest: the gateway keeps it on one replica
    # (gateway/routing/affinity.py, gateway/routing/placement.py); "" lets load alone choose.
    affinity: str = ""
    # A LoRA adapter added at run time: {"name", "source"}, so a replica that has not loaded it
    # yet loads it first (engine/loras.py); "check" on the admin API's try, which alone is told
    # why a load failed. None for every other request.
    adapter: dict[str, str] | None = None

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
    # Set by the model replica: when it started the request and when its first item was ready
    # (epoch seconds), the ends of the ``handle`` and ``engine`` stages (gateway/timing.py).
    timing: NotRequired[ReplicaTiming]


class ReplicaTiming(TypedDict):
    """Two moments of one request in the model replica, as ``time.time()``."""

    start: float
    first: float


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
    if prompt is not None and "prompt_tokens" not in usage:
        # Anthropic's input_tokens leave out the prompt's cached and cache-written parts.
        prompt = int(prompt) + sum(int(usage.get(k) or 0) for k in
                                   ("cache_read_input_tokens", "cache_creation_input_tokens"))
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
    if endpoint is not None and endpoint.error_event:
        event = {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    return sse_event(json.dumps(exc.to_body()).encode()) + SSE_DONE


def sse_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


# ---- the seam between the gateway and a model ----------------------------------------------------
class ModelCall(Protocol):
    """One call's answer, as the model sends it: a ``Head``, then (``Head.parts``) more ``bytes``,
    or for a stream ``Chunk`` tuples and a ``Trailer`` (the module docstring). ``__anext__``
    raises ``StopAsyncIteration`` at the end; a failure of the transport or the replica is raised
    from it as that transport's exception. ``cancel()`` stops the model's work at once (safe to
    call more than once, and after the end); it never raises."""

    def __anext__(self) -> Awaitable[Any]: ...
    def cancel(self) -> None: ...


class ModelClient(Protocol):
    """How the gateway calls one model (``gateway.routing.direct.DirectClient``: straight to the
    endpoint of the replica it picks; tests give stand-ins). ``call`` sends one request of
    ``ENDPOINTS[endpoint]`` with the gateway's ``RequestContext.to_dict()`` and returns at once;
    ``transport`` names how the last call travels (``serve-app diagnose`` shows it)."""

    @property
    def transport(self) -> str: ...
    def call(self, endpoint: str, body: dict[str, Any], ctx: dict[str, Any]) -> ModelCall: ...


@dataclass
class Answer:
    """A model's answer to one admitted request, whoever asked for it (HTTP or the batch runner).

    Either ``body`` (a complete answer, its request's books already closed) or ``events`` (a
    stream of SSE bytes, relayed as the model made them). A stream's request ends when
    ``finish()`` is awaited, however its reading ended (read to the end, stopped early, or never
    started): the consumer must await it exactly once, in a ``finally``. ``headers`` are the
    gateway's (limits, budgets, ``Server-Timing``, ``x-served-by``)."""

    status: int
    headers: dict[str, str]
    body: bytes | None = None
    events: AsyncIterator[bytes] | None = None
    finish: Callable[[], Awaitable[None]] | None = None
    # A stream's consumer calls this once its first bytes are out of its hands (written to the
    # client's connection, or read by the batch runner): the request's time to first token ends
    # there, not where the gateway got them.
    written: Callable[[], None] | None = None

    async def read(self) -> bytes:
        """The whole answer's bytes (a stream's events joined), its request ended."""
        if self.events is None:
            return self.body or b""
        parts: list[bytes] = []
        try:
            async for part in self.events:
                if not parts and self.written is not None:
                    self.written()
                parts.append(part)
        finally:
            if self.finish is not None:
                await self.finish()
        return b"".join(parts)
