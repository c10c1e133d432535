"""A console user over TestClient: sign in, read a page's CSRF token, post its forms."""

from __future__ import annotations

import re
from typing import Any

import httpx

from serve_app.gateway.http.console_session import COOKIE
from tests.unit.test_admin_api import Admin

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


class Console:
    """The admin API's test gateway (``Admin``: SQLite keys, state dir, audit log), driven as a
    browser would drive the console."""

    def __init__(self, admin: Admin) -> None:
        self.admin = admin
        self.client = admin.client

    def signin(self, key: str | None) -> httpx.Response:
        data = {"key": key or ""}
        return self.client.post("/console/signin", data=data, follow_redirects=False)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.client.get(path, follow_redirects=False, **kw)

    def csrf(self) -> str:
        page = self.get("/console/keys")
        assert page.status_code == 200, page.text
        found = CSRF.search(page.text)
        assert found is not None
        return found.group(1)

    def post(self, path: str, csrf: str | None = "auto", headers: dict[str, str] | None = None,
             **fields: str) -> httpx.Response:
        """A form post; ``csrf="auto"`` takes the token from the keys page, None sends none."""
        if csrf == "auto":
            csrf = self.csrf()
        if csrf is not None:
            fields["csrf"] = csrf
        return self.client.post(path, data=fields, headers=headers or {}, follow_redirects=False)

    @property
    def cookie(self) -> str | None:
        return self.client.cookies.get(COOKIE)

    def audit(self) -> str:
        return self.admin.audit()
