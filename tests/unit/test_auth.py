"""serve_app.gateway.keys.auth (secrets, the Authorization header) and the digests a key store
keeps (serve_app.state.keys)."""

from __future__ import annotations

import asyncio
import hashlib
import re
from pathlib import Path

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


def test_a_key_created_elsewhere_a_moment_ago_is_accepted_before_the_next_poll(
    tmp_path: Path,
) -> None:
    """Two replicas' stores on one SQLite file; the background poll is not running. A key created
    through the other store is accepted on its first request (an unknown secret refreshes the
    memory first), and a secret that stays unknown is refused 401."""
    from starlette.requests import Request

    from serve_app import errors
    from serve_app.config import GatewayConfig
    from serve_app.gateway.keys.access import identify
    from serve_app.gateway.keys.ops import KeyOps
    from serve_app.state.connections import Connections
    from serve_app.state.keys import open_key_store

    gw = GatewayConfig(state={"dir": str(tmp_path)},
                       keys={"store": "sqlite", "file": str(tmp_path / "keys.yaml")})

    def request(secret: str) -> Request:
        return Request({"type": "http", "method": "GET", "path": "/v1/models", "headers": [
            (b"authorization", f"Bearer {secret}".encode())]})

    async def go() -> None:
        here = open_key_store(gw.keys, Connections(None, tmp_path))
        await here.refresh(force=True)
        issued = await KeyOps(open_key_store(gw.keys, Connections(None, tmp_path))).create("fresh")
        assert here.lookup(issued.secret) is None  # the memory has not seen it yet
        await here.refresh()  # the poll has just looked: the interval has not passed again
        assert (await identify(request(issued.secret), here, None)).id == "fresh"
        with pytest.raises(errors.AuthenticationFailed):
            await identify(request(new_secret()), here, None)

    asyncio.run(go())
