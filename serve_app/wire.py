"""The gateway's stream to a model replica: one TCP connection per request, in frames.

A model replica serves its answers on a port of its own (``engine.endpoint``), and the gateway
connects to the replica it chose (``gateway.routing.direct``). Ray Serve still owns the replicas
(placement, autoscaling, health, rolling updates); only the request and its answer skip Ray's
handle, whose per-chunk cost (Ray Serve's replica wrapper, its gRPC stream, a second event loop
hop) made the deployment path about 0.6x direct vLLM's tokens/s at concurrency 64
(docs/PERFORMANCE.md, "One path").

Every frame is a 5-byte header (a kind byte, a big-endian 32-bit payload length) and the payload.
The gateway sends one ``REQUEST`` (JSON: the shared token, the endpoint, the body, the
``RequestContext``), then nothing more; the replica answers with the items of ``protocol``
(a ``HEAD``, then ``PART``s or ``CHUNK``s and a ``TRAILER``) and ``END``, or one ``REFUSED`` when it
takes no request (draining, or a wrong token). The replica closes after ``END``; the gateway
closing the connection early cancels the request (vLLM aborts it).

A head's payload is a 4-byte length, the head's fields as JSON (with ``load``: the requests in the
replica, counted after this one's start) and the head's body bytes. A chunk's is a 4-byte token
count and the SSE bytes, relayed as they are.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import orjson

from serve_app.protocol import Head

REQUEST, HEAD, PART, CHUNK, TRAILER, END, REFUSED = b"R", b"H", b"P", b"C", b"T", b"E", b"N"
_HEADER = struct.Struct(">cI")
_COUNT = struct.Struct(">I")
HEADER_BYTES = _HEADER.size
# The largest frame either side reads: a request body (the gateway caps bodies far below this) or
# a complete answer's part (``protocol.PART_BYTES``).
MAX_FRAME_BYTES = 64 * 1024 * 1024


class WireError(ConnectionError):
    """The peer sent something that is not a frame of this protocol."""


def frame(kind: bytes, payload: bytes) -> bytes:
    return _HEADER.pack(kind, len(payload)) + payload


def request(token: str, endpoint: str, body: dict[str, Any], ctx: dict[str, Any]) -> bytes:
    return frame(REQUEST, orjson.dumps({"token": token, "endpoint": endpoint, "body": body,
                                        "ctx": ctx}))


def item(value: Any, load: int) -> bytes:
    """One item of a model's answer (``protocol``: a head, a part, a chunk or a trailer)."""
    if isinstance(value, tuple):  # a Chunk: (SSE bytes, completion tokens so far)
        data: bytes = value[0]
        return _HEADER.pack(CHUNK, len(data) + 4) + _COUNT.pack(value[1]) + data
    if isinstance(value, bytes):
        return frame(PART, value)
    if "status" in value:  # a Head
        meta = {k: v for k, v in value.items() if k != "body"}
        meta["load"] = load
        encoded = orjson.dumps(meta)
        return frame(HEAD, _COUNT.pack(len(encoded)) + encoded + value["body"])
    return frame(TRAILER, orjson.dumps(value))


def refused(reason: str) -> bytes:
    return frame(REFUSED, orjson.dumps({"reason": reason}))


async def read_frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """The next frame's kind and payload. Raises ``asyncio.IncompleteReadError`` at a cut
    connection and ``WireError`` at something that is not a frame."""
    kind, size = _HEADER.unpack(await reader.readexactly(HEADER_BYTES))
    if size > MAX_FRAME_BYTES:
        raise WireError(f"frame of {size} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return kind, (await reader.readexactly(size) if size else b"")


def decode(kind: bytes, payload: bytes) -> Any:
    """A frame of the answer as the ``protocol`` item it carries (a ``Head`` keeps ``load``)."""
    if kind == CHUNK:
        return payload[4:], _COUNT.unpack_from(payload)[0]
    if kind == PART:
        return payload
    if kind == HEAD:
        (n,) = _COUNT.unpack_from(payload)
        h: Head = orjson.loads(payload[4:4 + n])
        h["body"] = payload[4 + n:]
        return h
    if kind == TRAILER:
        return orjson.loads(payload)
    raise WireError(f"unexpected frame kind {kind!r}")
