"""API key secrets: generation, digests and the request headers that carry them. Secrets are never
stored."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping

KEY_PREFIX = "sk-sa-"


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def digest(secret: str) -> str:
    return "sha256:" + hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def same_digest(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


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
