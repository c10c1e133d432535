"""What a stored response is, and how a turn that names ``previous_response_id`` is made whole.

A stored response is one JSON document in the state layer (``state/responses.py``)::

    {"id", "owner" (the tenant), "key_id", "root" (the first response of its chain),
     "created_at", "background", "heartbeat_at", "response" (the Response object as the client
     saw it), "input_items" (every item the model was given: the chain's earlier input and output,
     then this turn's input)}

The engine stores nothing (``store: false`` always reaches vLLM): the gateway sends the whole chain
as ``input``, so any replica of the model can answer the next turn, after any restart.
OpenAI's rules are kept: ``store`` defaults to true, ``instructions`` are not carried over from the
previous response, and ``background`` needs ``store``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from serve_app import errors

TERMINAL = frozenset({"completed", "failed", "cancelled", "incomplete"})
# The stream events that carry a response's final state (their data's "response").
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


def as_items(value: Any) -> list[Any]:
    """The Responses API's ``input`` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return list(value)
    raise errors.InvalidRequest("'input' must be a string or a list of items", param="input")


@dataclass
class Turn:
    """One ``POST /v1/responses`` as the gateway runs it: ``body`` goes to the model; the rest says
    what to keep of the answer."""

    body: dict[str, Any]
    store: bool
    background: bool
    stream: bool  # the client asked for a stream (a background run always streams internally)
    input_items: list[Any] = field(default_factory=list)
    previous_id: str | None = None
    root: str | None = None  # the chain's first response
    # The chain's affinity key: its first turn's, so every turn goes where its prefix is cached
    # (set by the service: ``StoredResponses.prepare``).
    affinity: str | None = None


def parse_turn(body: dict[str, Any], previous: dict[str, Any] | None) -> Turn:
    """``body`` as the model gets it, with ``previous`` (the stored document that
    ``previous_response_id`` names, already checked for its tenant) unrolled into ``input``."""
    store = body.get("store", True)
    background = body.get("background", False)
    if not isinstance(store, bool):
        raise errors.InvalidRequest("'store' must be a boolean", param="store")
    if not isinstance(background, bool):
        raise errors.InvalidRequest("'background' must be a boolean", param="background")
    if background and not store:
        raise errors.InvalidRequest("background responses must be stored: send store: true (or "
                                    "leave it out) with background: true", param="background")
    items = as_items(body.get("input", []))
    if previous is not None:
        items = list(previous["input_items"]) + list(previous["response"].get("output") or []) + items
    sent = {k: v for k, v in body.items() if k not in ("previous_response_id", "background")}
    sent["input"] = items
    sent["store"] = False  # the gateway keeps it; the engine never does
    stream = bool(body.get("stream", False))
    if background:
        sent["stream"] = True
    return Turn(body=sent, store=store, background=background, stream=stream, input_items=items,
                previous_id=previous["id"] if previous else None,
                root=(previous.get("root") or previous["id"]) if previous else None,
                affinity=previous.get("affinity") if previous else None)


def client_view(response: dict[str, Any], turn: Turn) -> dict[str, Any]:
    """The Response object as the client sees it: stored, in its chain, background or not."""
    return {**response, "store": True, "previous_response_id": turn.previous_id,
            "background": turn.background}


def new_doc(response: dict[str, Any], turn: Turn, owner: str, key_id: str) -> dict[str, Any]:
    """The stored document of a response the model has answered (or begun, for a background one)."""
    rid = str(response["id"])
    return {"id": rid, "owner": owner, "key_id": key_id, "root": turn.root or rid,
            "affinity": turn.affinity,
            "created_at": response.get("created_at") or int(time.time()),
            "background": turn.background, "heartbeat_at": time.time(),
            "response": client_view(response, turn), "input_items": turn.input_items}


def dump(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def item_prefix(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else "message"
    return {"message": "msg", "function_call": "fc", "function_call_output": "fco",
            "reasoning": "rs"}.get(str(kind), "item")


def listed_items(doc: dict[str, Any], limit: int, order: str, after: str | None) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: the items the model was given, each with an id
    (an item sent without one gets a stable id from its response and position)."""
    items = []
    for i, item in enumerate(doc["input_items"]):
        entry = dict(item) if isinstance(item, dict) else {"type": "message", "content": item}
        entry.setdefault("type", "message")
        entry.setdefault("id", f"{item_prefix(entry)}_{doc['id'][5:]}_{i}")
        if entry["type"] == "message" and isinstance(entry.get("content"), str):
            kind = "output_text" if entry.get("role") == "assistant" else "input_text"
            entry["content"] = [{"type": kind, "text": entry["content"]}]
        items.append(entry)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [it["id"] for it in items]
        if after not in ids:
            raise errors.InvalidRequest(f"no input item with id {after!r} in this response",
                                        param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit}


class EventSplitter:
    """SSE bytes, as they come in chunks, into whole events (``event: ...\\ndata: ...``)."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        parts = (self._rest + chunk).split(b"\n\n")
        self._rest = parts.pop()
        return [p + b"\n\n" for p in parts if p.strip()]


def event_kind(event: bytes) -> str:
    """An event's type from its ``event:`` line ("" when it has none)."""
    if event.startswith(b"event: "):
        return event[7:event.find(b"\n")].decode(errors="replace")
    return ""


def event_data(event: bytes) -> dict[str, Any]:
    """An event's JSON data ({} when it has none or it is not an object)."""
    at = event.find(b"data: ")
    if at < 0:
        return {}
    try:
        data = json.loads(event[at + 6:])
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
