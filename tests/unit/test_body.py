"""Request bodies are parsed strictly: what would become a 500 further down is a 400 naming the field."""

from __future__ import annotations

import pytest

from serve_app import errors
from serve_app.bodies import MAX_DEPTH, parse_body


def refused(raw: bytes) -> errors.InvalidRequest:
    with pytest.raises(errors.InvalidRequest) as info:
        parse_body(raw)
    assert info.value.status == 400
    return info.value


def test_a_plain_body_parses() -> None:
    body = parse_body(b'{"model": "m", "messages": [{"role": "user", "content": "hi \\ud83d\\ude00"}]}')
    assert body["messages"][0]["content"] == "hi \U0001f600"


@pytest.mark.parametrize("field", ["model", "stop", "user"])
def test_lone_surrogates_are_refused_naming_the_field(field: str) -> None:
    err = refused(b'{"max_tokens": 2, "%s": ["ok", "a\\ud800"]}' % field.encode())
    assert err.param == field and "surrogate" in err.message


def test_nesting_deeper_than_the_limit_is_refused_naming_the_field() -> None:
    ok = b'{"messages": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"
    parse_body(ok)
    for depth in (MAX_DEPTH, 300, 5000):
        err = refused(b'{"a": 1, "messages": ' + b"[" * depth + b"]" * depth + b"}")
        assert err.param == "messages"
    refused(b"[" * 5000 + b"]" * 5000)


def test_brackets_inside_strings_do_not_count() -> None:
    body = parse_body(b'{"prompt": "' + b"[{" * 500 + b'"}')
    assert body["prompt"].startswith("[{")


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_non_finite_numbers_are_refused(value: bytes) -> None:
    assert refused(b'{"temperature": ' + value + b"}").param == "temperature"


@pytest.mark.parametrize("value", [2**63, 2**64, 2**70, -(2**63) - 1, 10**400])
def test_integers_beyond_64_bits_are_refused(value: int) -> None:
    err = refused(b'{"model": "m", "top_k": %d}' % value)
    assert err.param == "top_k" and "64 bits" in err.message, err.message


def test_64_bit_integers_and_long_digit_strings_pass() -> None:
    assert parse_body(b'{"seed": %d}' % (2**63 - 1))["seed"] == 2**63 - 1
    assert parse_body(b'{"user": "123456789012345678901234567890"}')["user"].startswith("1234")


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b"1", b'"s"', b"\xef\xbb\xbf{}", b'{"a": "\xff"}',
                                 b'{"a": 1} x', b"{'a': 1}"])
def test_invalid_json_is_a_400(raw: bytes) -> None:
    refused(raw)
