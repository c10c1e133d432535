"""API key secrets: their generation and the request headers that carry them. Secrets are never
stored: a store keeps only their digest (``serve_app.state.keys.digest``)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping

KEY_PREFIX = "sk-sa-"


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None when absent or malformed."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        return None
    return token


def request_key(headers: Mapping[str, str]) -> str | None:
    """The API key a request carries: ``Authorization: Bearer <key>`` (OpenAI clients) or, when
    that is absent or malformed, ``x-api-key: <key>`` (Anthropic clients, Claude Code with
    ``ANTHROPIC_API_KEY``). Both are looked up the same way; None when neither holds a key."""
    token = bearer_token(headers.get("authorization"))
    if token is not None:
        return token
    key = (headers.get("x-api-key") or "").strip()
    if not key or " " in key:
        return None
    return key
