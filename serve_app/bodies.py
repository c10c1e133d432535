"""Request bodies: strict JSON, parsed by orjson, with the limits plain vLLM keeps, and the fields
the gateway refuses. One set of rules for the HTTP routes and for each line of a batch.

What the standard library's ``json`` lets through and something further down fails on (a 500, or a
request the engine never finishes), refused here with a 400 that names the field where it can:

- nesting deeper than ``MAX_DEPTH`` (``json`` recurses, and the request models after it too),
- lone UTF-16 surrogates (``"\\ud800"``) in any string: they cannot be encoded as UTF-8 later on,
- ``NaN``/``Infinity`` (not JSON) and numbers that overflow a double (``1e999``),
- integers outside 64 bits (orjson reads those as floats, which then pass as ints: ``top_k``
  of 2**70 reached the engine and stayed there unfinished).

A byte-order mark, invalid UTF-8, trailing data and duplicate-free garbage are just invalid JSON.
The common case pays one orjson parse and two byte counts.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

from serve_app import errors
from serve_app.protocol import INT64_MAX, INT64_MIN, json_offence

MAX_DEPTH = 64  # arrays and objects, counted from the body itself (depth 1)

# Fields that would point an upstream elsewhere or hand it other credentials (LiteLLM-style
# passthrough). The gateway owns routing and credentials, so these are refused outright.
FORBIDDEN_FIELDS = ("api_base", "base_url", "api_key", "extra_headers", "headers", "api_version",
                    "organization", "custom_llm_provider")


def check_fields(body: dict[str, Any]) -> None:
    """Refuse a body that names a field the gateway owns (``FORBIDDEN_FIELDS``)."""
    for name in FORBIDDEN_FIELDS:
        if name in body:
            raise errors.InvalidRequest(
                f"'{name}' is not accepted: this gateway chooses the upstream and its credentials",
                param=name,
            )


def check_size(size: int, limit: int) -> None:
    """Refuse a body over ``limit`` bytes (``gateway.http.max_body_bytes``)."""
    if size > limit:
        raise errors.PayloadTooLarge(f"request body is over the limit of {limit} bytes")

# JSON tokens that matter to the scan: a string (skipped whole), a bracket, a long integer.
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"\s*(:)?|([\[\]{}])|(-?\d{19,})(?![\d.eE])', re.S)
_LONG_INT = re.compile(rb"\d{19,}")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object in ``raw``, or an ``InvalidRequest`` naming what is wrong and where."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _explain(raw, str(exc)) from None
    if not isinstance(body, dict):
        raise errors.InvalidRequest("request body must be a JSON object")
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH or _LONG_INT.search(raw):
        _scan(raw)
    return body


def _scan(raw: bytes) -> None:
    """Refuse nesting deeper than MAX_DEPTH and integers outside 64 bits, naming the top-level
    field they are in (only called when a cheap count says either may be there)."""
    depth = 0
    field: str | None = None
    for m in _TOKENS.finditer(raw):
        colon, bracket, number = m.group(1), m.group(2), m.group(3)
        if bracket is not None:
            if bracket in (b"[", b"{"):
                depth += 1
                if depth > MAX_DEPTH:
                    raise errors.InvalidRequest(
                        f"{field or 'request body'}: JSON is nested deeper than {MAX_DEPTH} levels",
                        param=field)
            else:
                depth -= 1
        elif number is not None:
            value = int(number)
            if not INT64_MIN <= value <= INT64_MAX:
                raise errors.InvalidRequest(
                    f"{field or 'request body'}: integer {number[:24].decode()}"
                    f"{'...' if len(number) > 24 else ''} is out of range (64 bits)", param=field)
        elif colon is not None and depth == 1:
            key = m.group(0)
            key = key[: key.rindex(b":")].rstrip()
            try:
                field = json.loads(key)[:64]
            except ValueError:
                field = None


def _explain(raw: bytes, why: str) -> errors.InvalidRequest:
    """A 400 for JSON orjson refused, naming the field when the standard library (which is laxer:
    NaN, lone surrogates) can read the body and so show where the offence is."""
    why = why.split(": line ")[0]
    lowered = why.lower()
    if "depth" in lowered or "recursion" in lowered:
        try:
            _scan(raw)
        except errors.InvalidRequest as exc:
            return exc
        return errors.InvalidRequest(f"request body: JSON is nested deeper than {MAX_DEPTH} levels")
    try:
        lax = json.loads(raw)
    except (ValueError, RecursionError):
        return errors.InvalidRequest(f"request body is not valid JSON: {why}")
    if isinstance(lax, dict):
        for key, value in lax.items():
            bad = json_offence(value) or json_offence(key)
            if bad:
                name = key if isinstance(key, str) and not json_offence(key) else None
                return errors.InvalidRequest(f"{name or 'request body'}: {bad}", param=name)
    return errors.InvalidRequest(f"request body is not valid JSON: {why}")
