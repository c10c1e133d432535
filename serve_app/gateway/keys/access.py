"""Who a request is: its key from the store, checked for expiry, with failures audited.

The model routes (``api.authenticate``) and the admin routes (``admin.admin_key``) both start
here, then each refuses the other's role.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.requests import Request

from serve_app import errors
from serve_app.config import KeyRecord
from serve_app.gateway.accounting.audit import Audit
from serve_app.gateway.keys.auth import request_key
from serve_app.state.keys import KeyStore


def route_of(request: Request) -> str:
    """The matched route's template (never the raw path, which a client fills as it likes)."""
    route = request.scope.get("route")
    return str(getattr(route, "path", "?"))


async def identify(request: Request, keys: KeyStore, audit: Audit | None,
                   clock: Callable[[], float] = time.time) -> KeyRecord:
    """The request's active, unexpired key (from its headers), or 401 (``identify_secret``)."""
    return await identify_secret(request_key(request.headers), keys, audit, route_of(request),
                                 clock)


async def identify_secret(token: str | None, keys: KeyStore, audit: Audit | None, route: str,
                          clock: Callable[[], float] = time.time) -> KeyRecord:
    """The active, unexpired key whose secret is ``token``, or 401 (audited as ``auth_failed``
    on ``route``). The API's headers and the console's sign-in form both end here.

    Keys answer from memory. An unknown secret first checks the store's version (one cheap read,
    shared by concurrent unknown secrets), so a key created a moment ago on another replica or by
    ``serve-app keys`` is not refused while the background poll lags behind."""
    reason = "missing"
    key = None
    if token is not None:
        key = keys.lookup(token)
        if key is None:
            await keys.check_now()
            key = keys.lookup(token)
        reason = "unknown" if key is None else "expired"
    if key is not None and not key.expired(clock()):
        return key
    if audit is not None:
        audit.record("auth_failed", actor=key.id if key is not None else None, target=None,
                     result=reason, route=route)
    if reason == "missing":
        raise errors.AuthenticationFailed(
            "Missing or malformed API key. Send the header 'Authorization: Bearer <key>' "
            "or 'x-api-key: <key>'."
        )
    if reason == "expired":
        raise errors.AuthenticationFailed("This API key has expired.")
    raise errors.AuthenticationFailed("Incorrect API key provided.")
