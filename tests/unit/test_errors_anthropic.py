"""serve_app.errors: every error rendered in Anthropic's envelope, as Anthropic SDKs and Claude Code
read it (error type, 529 for overload with retry-after, "prompt is too long")."""

from __future__ import annotations

import json

import pytest

from serve_app import errors


@pytest.mark.parametrize(
    ("exc", "status", "type_"),
    [
        (errors.InvalidRequest("bad"), 400, "invalid_request_error"),
        (errors.AuthenticationFailed("no key"), 401, "authentication_error"),
        (errors.PermissionDenied("no"), 403, "permission_error"),
        (errors.ModelNotFound("no model"), 404, "not_found_error"),
        (errors.NotFound("Unknown path."), 404, "not_found_error"),
        (errors.PayloadTooLarge("big"), 413, "request_too_large"),
        (errors.UnsupportedMediaType("xml"), 415, "invalid_request_error"),
        (errors.RateLimited("slow down", headers={"Retry-After": "7"}), 429, "rate_limit_error"),
        (errors.InternalError("oops"), 500, "api_error"),
        (errors.ServiceUnavailable("busy"), 529, "overloaded_error"),
        (errors.Shed("shed"), 529, "overloaded_error"),
        (errors.GatewayTimeout("slow"), 504, "timeout_error"),
    ],
)
def test_status_and_type(exc: errors.ServeAppError, status: int, type_: str) -> None:
    got_status, body, _ = errors.anthropic_error(exc)
    assert got_status == status
    assert body == {"type": "error", "error": {"type": type_, "message": exc.message}}


def test_overload_keeps_its_retry_after() -> None:
    exc = errors.Shed("shed", retry_after_s=4)
    _, _, headers = errors.anthropic_error(exc)
    assert headers == exc.headers and 4 <= int(headers["Retry-After"]) <= 8


def test_overload_always_has_a_retry_after() -> None:
    exc = errors.ServiceUnavailable("busy")
    exc.headers.clear()
    status, _, headers = errors.anthropic_error(exc)
    assert status == 529 and headers["Retry-After"] == "1"


def test_rate_limit_headers_pass_through() -> None:
    exc = errors.RateLimited("slow", headers={"Retry-After": "3", "retry-after-ms": "2500"})
    _, _, headers = errors.anthropic_error(exc)
    assert headers == {"Retry-After": "3", "retry-after-ms": "2500"}


def test_context_length_reads_prompt_is_too_long() -> None:
    exc = errors.ContextLengthExceeded(
        "This model's maximum context length is 2048 tokens. However, you requested 3000 tokens.",
        param="messages",
    )
    status, body, _ = errors.anthropic_error(exc)
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("prompt is too long: ")
    assert "2048" in body["error"]["message"]


def test_context_length_wording_not_doubled() -> None:
    exc = errors.ContextLengthExceeded("Prompt is too long: 3000 tokens > 2048 maximum")
    _, body, _ = errors.anthropic_error(exc)
    assert body["error"]["message"] == "Prompt is too long: 3000 tokens > 2048 maximum"


def test_rendering_does_not_change_the_openai_body() -> None:
    exc = errors.Shed("shed")
    errors.anthropic_error(exc)
    assert exc.status == 503 and exc.to_body()["error"]["type"] == "server_error"


def test_sse_error_event() -> None:
    raw = errors.anthropic_sse_error(errors.ServiceUnavailable("engine gone"))
    event, data = raw.decode().rstrip("\n").split("\n")
    assert event == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "engine gone"}}
    assert raw.endswith(b"\n\n")

