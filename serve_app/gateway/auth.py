"""API key secrets: generation, digests and the Authorization header. Secrets are never stored."""

from __future__ import annotations

import hashlib
import hmac
import secrets

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
