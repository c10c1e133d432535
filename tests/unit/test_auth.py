"""serve_app.gateway.keys.auth (secrets, the Authorization header) and the digests a key store
keeps (serve_app.state.keys)."""

from __future__ import annotations

import hashlib
import re

import pytest

from serve_app.gateway.keys.auth import KEY_PREFIX, bearer_token, new_secret
from serve_app.state.keys import digest, same_digest


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer sk-sa-abc", "sk-sa-abc"),
        ("bearer sk-sa-abc", "sk-sa-abc"),
        ("BEARER sk-sa-abc", "sk-sa-abc"),
        ("Bearer   sk-sa-abc  ", "sk-sa-abc"),
        ("  Bearer sk-sa-abc", "sk-sa-abc"),
    ],
)
def test_bearer_token_accepted(header: str, token: str) -> None:
    assert bearer_token(header) == token


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "   ",
        "Bearer",
        "Bearer ",
        "Basic dXNlcjpwYXNz",
        "Token sk-sa-abc",
        "sk-sa-abc",
        "Bearer sk-sa-abc extra",
        "Bearer sk-sa a b",
    ],
)
def test_bearer_token_rejected(header: str | None) -> None:
    assert bearer_token(header) is None


def test_digest_is_prefixed_sha256_hex() -> None:
    d = digest("sk-sa-secret")
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", d)
    assert d == "sha256:" + hashlib.sha256(b"sk-sa-secret").hexdigest()
    assert digest("sk-sa-secret") == d
    assert digest("sk-sa-secreT") != d


def test_digest_does_not_contain_the_secret() -> None:
    assert "secret" not in digest("sk-sa-secret")


def test_new_secrets_are_prefixed_long_and_unique() -> None:
    secrets = {new_secret() for _ in range(50)}
    assert len(secrets) == 50
    for s in secrets:
        assert s.startswith(KEY_PREFIX)
        assert len(s) >= len(KEY_PREFIX) + 40
        assert bearer_token(f"Bearer {s}") == s  # usable as-is in a header


def test_same_digest() -> None:
    d = digest("a")
    assert same_digest(d, digest("a"))
    assert not same_digest(d, digest("b"))
