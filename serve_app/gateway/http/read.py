"""Reading a request's body: only after its key was checked (the routes' dependencies run first),
only as JSON, and never past a limit: a body over it is refused (413) by its declared length
before any of it is read, else as soon as the bytes read pass the limit."""

from __future__ import annotations

from starlette.requests import Request

from serve_app import errors
from serve_app.bodies import check_size


def require_json(request: Request) -> None:
    """415 unless the body is declared ``application/json``."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise errors.UnsupportedMediaType(
            f"Content-Type must be application/json, not {ctype[:64] or 'missing'!r}"
        )


async def read_capped(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) as soon as it is over ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit():
        check_size(int(declared), limit)
    raw = bytearray()
    async for part in request.stream():
        raw += part
        check_size(len(raw), limit)
    return bytes(raw)
