"""ASGI middleware for Ray Serve's HTTP proxy (the hop in front of the gateway replicas).

Ray's proxy takes the client's ``X-Request-Id`` as the request id and echoes it in the response.
This middleware runs before that and drops an id that is longer than 128 characters or not plain
(letters, digits, ``._:-``), so Ray generates a fresh one instead; a hostile id is never echoed.

Enable it with ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=serve_app.gateway.http.proxy_middleware:middlewares``
in the environment of the Ray cluster (``serve-app run`` sets it for the local cluster).
"""

from __future__ import annotations

import re
from typing import Any

from starlette.middleware import Middleware

IMPORT_PATH = "serve_app.gateway.http.proxy_middleware:middlewares"
_PLAIN_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")


class SanitizeRequestId:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = scope.get("headers") or []
            if any(k == b"x-request-id" and not _PLAIN_ID.match(v) for k, v in headers):
                scope = dict(scope)
                scope["headers"] = [(k, v) for k, v in headers if k != b"x-request-id"]
        await self.app(scope, receive, send)


def middlewares() -> list[Middleware]:
    return [Middleware(SanitizeRequestId)]
