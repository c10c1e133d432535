"""One exception hierarchy. Each class knows its HTTP status and its OpenAI error type and code.

Every error that reaches a client is rendered from one of these, in exactly one place per dialect:
``to_body`` gives OpenAI's ``{"error": {"message", "type", "param", "code"}}``, and
``anthropic_error`` gives Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (the
Messages API routes).
"""

from __future__ import annotations

import json
import math
import random
from typing import Any


class ServeAppError(Exception):
    """Base class: an error with an HTTP status and an OpenAI-shaped body."""

    status: int = 500
    type: str = "server_error"
    code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})

    def to_body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class InvalidRequest(ServeAppError):
    """The request itself is wrong (body, parameter, value): the client must change it, a retry
    as is fails again. ``param`` names the field when one is to blame."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ContextLengthExceeded(InvalidRequest):
    """The prompt plus ``max_tokens`` does not fit the model's context. A code of its own (OpenAI's),
    because clients act on it differently from other 400s: they shorten the prompt."""

    code = "context_length_exceeded"


class AuthenticationFailed(ServeAppError):
    """No key, or a key that is unknown or revoked. The message never echoes the key sent."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(ServeAppError):
    """A 403 from below (an engine or Starlette) in the OpenAI envelope. The gateway itself answers
    a key that may not use a model with ``ModelNotFound``, so the key learns nothing more."""

    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


class ModelNotFound(ServeAppError):
    """No model or alias of that name, or none this key may see (the two are not told apart, so a
    key cannot probe for models it has no access to)."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NotFound(ServeAppError):
    """A path that is not served (Starlette's or an engine's 404, in the OpenAI envelope)."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(ServeAppError):
    """A known path called with the wrong HTTP method."""

    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(ServeAppError):
    """The body is over ``gateway.http.max_body_bytes``; refused before it is parsed."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaType(ServeAppError):
    """A body that is not sent as ``application/json``."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class Refused(ServeAppError):
    """The one way out of admission (``Admission.enter``): the request was not run, and may be
    retried later. It carries its status, code, message and, where one is known,
    ``Retry-After`` (``retry_after_s``). Subclasses name the reason; each medium renders it once
    (a JSON body, a mid-stream SSE error event, a batch error record)."""

    status = 503

    @property
    def retry_after_s(self) -> float | None:
        value = next((v for k, v in self.headers.items() if k.lower() == "retry-after"), None)
        try:
            return float(value) if value is not None else None
        except ValueError:
            return None


class RateLimited(Refused):
    """A key or tier window (requests or tokens per minute) refused the request; it carries
    ``Retry-After`` for when the window has room for it again."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class ConcurrencyLimited(RateLimited):
    """The key or its tier has its most requests in flight; room comes when one of them ends."""

    code = "concurrency_limit_exceeded"


class QuotaExceeded(RateLimited):
    """A key's or tenant's token budget for the day or month is spent (OpenAI's code for it).

    Its ``Retry-After`` is the time to the budget's reset, and ``x-should-retry: false`` tells the
    openai and anthropic SDKs not to retry at all: a retry within the period fails again, and an
    agent should stop at once and show the message instead of retrying for minutes."""

    type = "insufficient_quota"
    code = "insufficient_quota"

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.headers["x-should-retry"] = "false"


class Conflict(ServeAppError):
    """The change conflicts with the current state (an admin API create of an existing key id)."""

    status = 409
    type = "invalid_request_error"
    code = "conflict"


class InternalError(ServeAppError):
    """A failure of ours with no better status; the message is generic so that nothing internal
    (paths, exception text) reaches the client."""

    status = 500
    type = "server_error"
    code = "internal_error"


class ServiceUnavailable(Refused):
    """The model is down, starting, or shedding load. Always carries ``Retry-After``."""

    status = 503
    type = "server_error"
    code = "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: int = 1, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.headers.setdefault("Retry-After", str(max(1, int(retry_after_s))))


class ShuttingDown(ServiceUnavailable):
    """The app is stopping (draining): another gateway replica, or this one restarted, answers."""

    code = "shutting_down"


class Overloaded(ServiceUnavailable):
    """The model is full right now (its capacity). The wait is short and jittered, from
    ``retry_after_s`` to twice it (``retry-after-ms`` has it to the millisecond; ``Retry-After``,
    whole seconds, rounds it up), so that the clients refused in one burst do not all come back
    in the same instant and make the next burst."""

    code = "model_at_capacity"

    def __init__(self, message: str, *, retry_after_s: float = 1, **kwargs: Any) -> None:
        wait = retry_after_s * (1 + random.random())
        super().__init__(message, retry_after_s=math.ceil(wait), **kwargs)
        self.headers["retry-after-ms"] = str(round(wait * 1000))


class Shed(Overloaded):
    """The model is saturated and the key's tier is shed before the tiers above it."""

    code = "tier_shed"


class QueueTimeout(Overloaded):
    """The request waited in the model's flow queue past its tier's bound."""

    code = "queue_timeout"


class AnswerBroken(ServeAppError):
    """The model began a complete answer (its head arrived) and broke before the rest came.

    Unlike ``ServiceUnavailable`` the model did run the request, so it is neither re-run on a
    fallback nor booked as a rejection: it is a failure whose token usage is unknown.
    """

    status = 502
    type = "server_error"
    code = "bad_gateway"


class GatewayTimeout(ServeAppError):
    """The model did not answer within ``gateway.http.request_timeout_s`` (every await on an engine is
    bounded)."""

    status = 504
    type = "server_error"
    code = "timeout"


_BY_STATUS: dict[int, type[ServeAppError]] = {
    400: InvalidRequest,
    401: AuthenticationFailed,
    403: PermissionDenied,
    404: NotFound,
    405: MethodNotAllowed,
    413: PayloadTooLarge,
    415: UnsupportedMediaType,
    429: RateLimited,
    503: ServiceUnavailable,
    504: GatewayTimeout,
}


def for_status(status: int) -> type[ServeAppError]:
    """The error class for an HTTP status; 422 is folded into 400 (OpenAI never sends 422)."""
    if status == 422:
        return InvalidRequest
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    return InvalidRequest if 400 <= status < 500 else InternalError


# ---- Anthropic's envelope ------------------------------------------------------------------------
# The Messages API routes (/v1/messages, /v1/messages/count_tokens) answer in Anthropic's dialect,
# so that Anthropic SDKs and Claude Code read the error type and retry the way they do upstream.
ANTHROPIC_OVERLOADED_STATUS = 529  # Anthropic's "overloaded" status; its clients back off and retry

_ANTHROPIC_TYPE: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
# Claude Code recognises a too-long prompt by this wording and then offers to compact the
# conversation; any other message is shown as a plain API error.
PROMPT_TOO_LONG = "prompt is too long"


def anthropic_error(exc: ServeAppError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """``exc`` as Anthropic renders it: (status, ``{"type": "error", "error": {...}}``, headers).

    503 (overload, shedding, a model not ready) becomes 529 ``overloaded_error``; it always keeps
    a ``retry-after`` header. A context-length error reads "prompt is too long: ...".
    """
    status = exc.status
    type_ = _ANTHROPIC_TYPE.get(status, "api_error" if status >= 500 else "invalid_request_error")
    headers = dict(exc.headers)
    if status == 503:
        status = ANTHROPIC_OVERLOADED_STATUS
        if not any(h.lower() == "retry-after" for h in headers):
            headers["Retry-After"] = "1"
    message = exc.message
    if isinstance(exc, ContextLengthExceeded) and PROMPT_TOO_LONG not in message.lower():
        message = f"{PROMPT_TOO_LONG}: {message}"
    return status, anthropic_body(message, type_), headers


def anthropic_body(message: str, type_: str) -> dict[str, Any]:
    """The Anthropic error envelope."""
    return {"type": "error", "error": {"type": type_, "message": message}}


def anthropic_sse_error(exc: ServeAppError) -> bytes:
    """An ``error`` event that ends an Anthropic stream which has already started (status 200)."""
    _, body, _ = anthropic_error(exc)
    return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"

