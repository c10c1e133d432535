"""What crosses a deployment handle between the gateway and a model replica.

Only plain data crosses: a JSON-serialisable ``RequestContext`` goes down with the parsed body, and
a model method answers with a stream whose first item is a ``head`` dict and whose later items are
``bytes`` (SSE chunks, already serialised in the model replica so the gateway relays them as-is).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class RequestContext:
    """Per-request facts the gateway decided; travels to the model replica as a dict."""

    request_id: str
    key_id: str
    tier: str
    priority: int = 0
    deadline: float = 0.0  # epoch seconds; 0 means none
    tenant: str = ""  # keys of one tenant share vLLM's prefix cache; others cannot probe it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestContext:
        return cls(**d)

    def remaining_s(self, default: float) -> float:
        if not self.deadline:
            return default
        return max(0.001, self.deadline - time.time())


def head(
    status: int, body: bytes, *, stream: bool = False, usage: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The first item of every model answer: status, whether a stream follows, the first bytes,
    and (for a complete answer) its token usage."""
    return {"status": status, "stream": stream, "body": body, "usage": usage}


def trailer(usage: dict[str, Any] | None) -> dict[str, Any]:
    """The last item of a stream: its token usage, for the gateway's accounting (never relayed)."""
    return {"usage": usage}


def total_tokens(usage: dict[str, Any] | None) -> int | None:
    if not usage:
        return None
    total = usage.get("total_tokens")
    if isinstance(total, int):
        return total
    return int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)


def sse_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"
