"""One exception hierarchy. Each class knows its HTTP status and its OpenAI error type and code.

Every error that reaches a client is rendered from one of these by ``to_body``, so the JSON shape
``{"error": {"message", "type", "param", "code"}}`` is produced in exactly one place.
"""

from __future__ import annotations

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
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class AuthenticationFailed(ServeAppError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(ServeAppError):
    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


class ModelNotFound(ServeAppError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class NotFound(ServeAppError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(ServeAppError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(ServeAppError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaType(ServeAppError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class RateLimited(ServeAppError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class InternalError(ServeAppError):
    status = 500
    type = "server_error"
    code = "internal_error"


class ServiceUnavailable(ServeAppError):
    """The model is down, starting, or shedding load. Always carries ``Retry-After``."""

    status = 503
    type = "server_error"
    code = "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: int = 1, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.headers.setdefault("Retry-After", str(max(1, int(retry_after_s))))


class Shed(ServiceUnavailable):
    """The model is saturated and the key's tier is shed before the tiers above it."""


class GatewayTimeout(ServeAppError):
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
