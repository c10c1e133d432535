"""The console's sessions and CSRF defences (``console.py``'s routes use them).

A session is a cookie ``<payload>.<mac>``: the payload (base64url JSON) holds the admin key's id,
a fingerprint of the key's digest (so rotating the key ends its sessions), the expiry and a nonce;
the mac is HMAC-SHA256 over it with the console's secret (``gateway.console.secret``, or the one
the state layer keeps: ``state/secrets.py``). No secret is in the cookie: not the key's, not the
console's. A cookie that does not verify, or has expired, is no session. The key itself is
re-checked on every request (``console.py``), so a revoked or expired key's session ends at once.

Every state-changing POST carries a CSRF token, HMAC of the session cookie under the same secret
(another purpose byte string, so a token is never a valid mac of anything else), and is refused
when ``Origin`` or ``Referer`` names another host, or ``Sec-Fetch-Site`` says cross-site. Its
form is read here too (``read_form``: capped, urlencoded only).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from serve_app import errors
from serve_app.config import KeyRecord
from serve_app.gateway.http.console_pages import HEADERS
from serve_app.gateway.http.read import read_capped

COOKIE = "serve_app_console"
PATH = "/console"
FORM_LIMIT = 16 * 1024  # a console form is a few hundred bytes
logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Session:
    """A verified, unexpired session: whose it is, and the cookie it came in."""

    key_id: str
    key_mark: str  # the fingerprint of the key's digest at sign-in
    expires: int
    cookie: str


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Signer:
    """Issues and verifies sessions and CSRF tokens with one secret."""

    def __init__(self, secret: bytes, ttl_s: int, clock: Callable[[], float] = time.time) -> None:
        self._secret = secret
        self.ttl_s = ttl_s
        self._clock = clock

    def _mac(self, purpose: bytes, data: str) -> str:
        return _b64(hmac.new(self._secret, purpose + b"\0" + data.encode(), hashlib.sha256).digest())

    def key_mark(self, key: KeyRecord) -> str:
        """A fingerprint of the key's digest: a rotated key no longer matches its sessions."""
        return self._mac(b"key", key.digest)[:22]

    def issue(self, key: KeyRecord) -> str:
        """A new session cookie's value for ``key``, valid for ``ttl_s``."""
        payload = _b64(json.dumps({
            "k": key.id, "m": self.key_mark(key), "e": int(self._clock()) + self.ttl_s,
            "n": secrets.token_urlsafe(12)}, separators=(",", ":")).encode())
        return f"{payload}.{self._mac(b'session', payload)}"

    def read(self, cookie: str | None) -> Session | None:
        """The session in ``cookie``, or None when it is absent, forged, tampered or expired."""
        if not cookie or cookie.count(".") != 1 or len(cookie) > 1024:
            return None
        payload, mac = cookie.split(".")
        if not hmac.compare_digest(mac.encode(), self._mac(b"session", payload).encode()):
            return None
        try:
            doc = json.loads(_unb64(payload))
            key_id, mark, expires = str(doc["k"]), str(doc["m"]), int(doc["e"])
        except (ValueError, KeyError, TypeError, binascii.Error):
            return None
        if expires <= self._clock():
            return None
        return Session(key_id, mark, expires, cookie)

    def belongs(self, session: Session, key: KeyRecord | None) -> bool:
        """Whether ``key`` (the store's record of the session's id, now) still carries it: active,
        admin, unexpired, and not rotated since sign-in."""
        return (key is not None and key.id == session.key_id and key.role == "admin"
                and not key.revoked and not key.expired(self._clock())
                and hmac.compare_digest(self.key_mark(key), session.key_mark))

    def csrf(self, session: Session) -> str:
        """The session's CSRF token (the hidden field of every form)."""
        return self._mac(b"csrf", session.cookie)

    def csrf_ok(self, session: Session, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.csrf(session).encode())


def cross_site(headers: Mapping[str, str]) -> bool:
    """Whether a request comes from another site: ``Sec-Fetch-Site`` says so, or its ``Origin``
    (else its ``Referer``) names a host other than the one it was sent to. A request with
    neither (curl, some privacy settings) passes here; its CSRF token still has to match."""
    if headers.get("sec-fetch-site", "").lower() in ("cross-site", "same-site"):
        return True
    host = headers.get("host", "").lower()
    for name in ("origin", "referer"):
        value = headers.get(name)
        if value is not None:
            try:
                netloc = urlsplit(value).netloc.lower()
            except ValueError:
                return True
            return netloc != host or not host  # "null" (an opaque origin) has no host: refused
    return False


async def signer_for(request: Request) -> Signer | None:
    """The replica's signer, made once: ``gateway.console.secret``, else the state layer's shared
    secret, else (one replica, no Redis, no state dir) a secret of this process. None when there
    is no secret every replica shares: the caller answers 503."""
    signer: Signer | None = getattr(request.app.state, "console_signer", None)
    if signer is not None:
        return signer
    d = request.app.state.deps
    ccfg = d.cfg.gateway.console
    secret = ccfg.secret.encode() if ccfg.secret else None
    if secret is None and d.secrets is not None:
        try:
            secret = await d.secrets("console")
        except Exception as exc:  # Redis down or the file unreadable: no sessions for now
            logger.error("console secret not read: %s", exc.__class__.__name__)
            return None
    if secret is None:
        if d.cfg.gateway.num_replicas > 1:
            return None  # replicas would refuse each other's sessions
        secret = secrets.token_bytes(32)
    request.app.state.console_signer = signer = Signer(secret, ccfg.session_ttl_s)
    return signer


def to_signin() -> Response:
    """The redirect to the sign-in form, ending the session cookie this browser holds."""
    resp = RedirectResponse(PATH + "/signin", status_code=303, headers=HEADERS)
    resp.delete_cookie(COOKIE, path=PATH)
    return resp


async def read_form(request: Request) -> dict[str, str]:
    """A urlencoded form's fields (the first value of each), read under ``FORM_LIMIT``."""
    raw = await read_capped(request, FORM_LIMIT)
    if not raw:  # a form with no fields (a button alone) may come without a type
        return {}
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/x-www-form-urlencoded":
        raise errors.UnsupportedMediaType("A console form is sent as application/x-www-form-urlencoded.")
    try:
        fields = parse_qs(raw.decode(), keep_blank_values=True, max_num_fields=32, strict_parsing=False)
    except (UnicodeDecodeError, ValueError):
        raise errors.InvalidRequest("The form could not be read.") from None
    return {k: v[0] for k, v in fields.items()}
