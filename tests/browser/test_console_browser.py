"""The console in a real browser (selenium + Debian's headless /usr/bin/chromium): the gateway app
of the unit tests (SQLite keys, state dir, fake models; no Ray) served by uvicorn on a free
loopback port. Sign in, create a key and see it listed, revoke it, and a client key is refused.

With ``SERVE_APP_SCREENSHOTS=1`` each page is saved to ``docs/img/console-<page>.png`` (off by
default, so a test run leaves the tree clean)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from serve_app.gateway.http.api import build_api
from serve_app.gateway.keys.ops import KeyOps
from serve_app.local.ports import free_port
from tests.browser.chrome import click_and_wait, running_chrome, sign_in
from tests.keys import run
from tests.unit.test_admin_api import Admin

IMG = Path(__file__).resolve().parents[2] / "docs" / "img"


class Served:
    """The app on ``url`` while the ``with`` block runs."""

    def __init__(self, app: Any) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                lifespan="off", ws="none")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="console-uvicorn", daemon=True)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    with running_chrome(tmp_path) as driver:
        yield driver


def _shot(driver: Any, page: str) -> None:
    if os.environ.get("SERVE_APP_SCREENSHOTS") == "1":
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1280, max(600, min(int(height) + 40, 2400)))
        driver.save_screenshot(str(IMG / f"console-{page}.png"))
        driver.set_window_size(1280, 900)


def test_sign_in_create_list_and_revoke_a_key(browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    admin = Admin(tmp_path)
    run(KeyOps(admin.deps.keys).create("batch-team", tenant="acme"))
    with Served(build_api(admin.deps)) as served:
        browser.get(served.url + "/console/keys")
        assert browser.current_url.endswith("/console/signin")  # signed out: the sign-in form
        _shot(browser, "signin")
        sign_in(browser, served.url, admin.admin)
        assert browser.current_url.endswith("/console/keys")
        assert browser.find_element(By.TAG_NAME, "h1").text == "Keys"
        assert browser.get_cookie("serve_app_console")["httpOnly"] is True

        browser.find_element(By.ID, "id").send_keys("web-team")
        Select(browser.find_element(By.ID, "tier")).select_by_value("standard")
        browser.find_element(By.ID, "tenant").send_keys("acme")
        browser.find_element(By.ID, "budget_tokens").send_keys("500000")
        click_and_wait(browser, browser.find_element(By.XPATH, "//button[text()='Create key']"))
        secret = browser.find_element(By.ID, "new-secret").text
        assert secret.startswith("sk-sa-")
        assert admin.call("GET", "/v1/models", secret).status_code == 200
        row = browser.find_element(By.XPATH, "//tr[th[@scope='row' and text()='web-team']]")
        assert "standard" in row.text and "acme" in row.text and "active" in row.text
        _shot(browser, "keys")

        click_and_wait(browser, row.find_element(By.XPATH, ".//button[text()='Revoke']"))
        row = browser.find_element(By.XPATH, "//tr[th[@scope='row' and text()='web-team']]")
        assert "revoked" in row.text
        assert admin.call("GET", "/v1/models", secret).status_code == 401

        for page in ("usage", "sla", "replicas", "batches", "audit"):
            link = {"audit": "Audit log", "sla": "SLA"}.get(page, page.capitalize())
            click_and_wait(browser, browser.find_element(By.LINK_TEXT, link))
            assert browser.current_url.endswith(f"/console/{page}")
            _shot(browser, page)
        assert "key.revoke" in browser.find_element(By.TAG_NAME, "table").text

        click_and_wait(browser, browser.find_element(By.XPATH, "//button[text()='Sign out']"))
        assert browser.current_url.endswith("/console/signin")
    log = admin.audit()
    assert '"action":"key.create","target":"web-team","result":"ok"' in log
    assert '"action":"key.revoke","target":"web-team","result":"ok"' in log


def test_a_client_key_cannot_open_the_console(browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    admin = Admin(tmp_path)
    client = run(KeyOps(admin.deps.keys).create("app")).secret
    with Served(build_api(admin.deps)) as served:
        sign_in(browser, served.url, client)
        assert "Sign-in refused" in browser.find_element(By.CSS_SELECTOR, "[role=alert]").text
        assert browser.get_cookie("serve_app_console") is None
        browser.get(served.url + "/console/keys")
        assert browser.current_url.endswith("/console/signin")
