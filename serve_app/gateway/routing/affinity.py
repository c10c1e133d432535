"""The affinity key of a request: what the model deployment's router keeps on one replica.

A prefix-cache hit needs the same tokens on the same replica. The key is the tenant (the same one
that becomes vLLM's ``cache_salt``, so two tenants' keys never collide and never share a cache)
plus the client's session when it names one, else a hash of the prompt's leading text:

- ``X-Claude-Code-Session-Id`` (Claude Code), ``session-id`` / ``session_id`` (Codex),
- ``prompt_cache_key`` (OpenAI's own cache-routing field; Codex sends it too) or ``user`` in the
  body,
- otherwise the first ``PREFIX_CHARS`` characters of the system prompt and messages (the leading
  blocks of the prompt: requests that share them share cached blocks).

A request for a LoRA adapter is keyed by the adapter alone (``adapter_affinity``): all of its
requests, every session and tenant, share the adapter's home replica, so the adapter is loaded on
one replica instead of on all of them, and each session's prefix stays cached there too. The load
guard still spills a hot adapter to its next-ranked replica.

The key is a digest, so no session id or prompt text crosses the handle or reaches a log line.
``serve_app.gateway.routing.placement`` reads it from ``RequestContext.affinity``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from serve_app.protocol import Endpoint

SESSION_HEADERS = ("x-claude-code-session-id", "session-id", "session_id")
SESSION_FIELDS = ("prompt_cache_key", "user")
# About the first 1k tokens: the leading blocks that agent turns and tenant prompts share.
PREFIX_CHARS = 4096


def session_id(headers: Mapping[str, str], body: Mapping[str, Any]) -> str:
    """The session the client names (a header first, then the body), or ""."""
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return f"h:{value}"
    for name in SESSION_FIELDS:
        value = body.get(name)
        if isinstance(value, str) and value:
            return f"b:{value}"
    return ""


def leading_text(body: Mapping[str, Any], endpoint: Endpoint, limit: int = PREFIX_CHARS) -> str:
    """The first ``limit`` characters of the prompt's text, in prompt order: the system prompt or
    instructions, then the endpoint's main input (messages, prompt, input)."""
    parts: list[str] = []
    size = 0
    todo: list[Any] = [body.get(endpoint.main_param), body.get("instructions"), body.get("system")]
    while todo and size < limit:
        v = todo.pop()
        if isinstance(v, str):
            parts.append(v)
            size += len(v)
        elif isinstance(v, dict):
            todo.extend(reversed([v.get("text"), v.get("content")]))
        elif isinstance(v, list):
            todo.extend(reversed(v))
    return "".join(parts)[:limit]


def affinity_key(tenant: str, endpoint: Endpoint, headers: Mapping[str, str],
                 body: Mapping[str, Any]) -> str:
    """The request's affinity key: a digest of tenant and session (or of tenant and leading text)."""
    session = session_id(headers, body)
    what = session or "p:" + leading_text(body, endpoint)
    return hashlib.sha256(f"{tenant}\x1f{what}".encode()).hexdigest()[:32]


def adapter_affinity(adapter: str) -> str:
    """The affinity key of every request for the LoRA adapter ``adapter``."""
    return hashlib.sha256(f"adapter\x1f{adapter}".encode()).hexdigest()[:32]
