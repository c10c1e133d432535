"""Headless Debian chromium driven by selenium, for the console's browser tests (tests/browser on
the unit app, tests/integration/test_console_real.py on the real stack)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM, DRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


def chrome(profile: Path) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,900", f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    return webdriver.Chrome(options=opts, service=Service(executable_path=str(DRIVER)))


@contextmanager
def running_chrome(tmp_path: Path) -> Iterator[Any]:
    """A driver for the block (quit at its end); a skip when chromium is missing (a failure under
    CI: tests/conftest.py)."""
    if not (CHROMIUM.exists() and DRIVER.exists()):
        pytest.skip("chromium is not installed (run scripts/system-deps.sh)")
    driver = chrome(tmp_path / "chrome-profile")
    try:
        yield driver
    finally:
        driver.quit()


def click_and_wait(driver: Any, button: Any) -> None:
    """Click a link or a form's button and wait until the next page has loaded: a click may
    return before the browser has left the old page, and an element found then is gone a moment
    later. The old page's window is marked, and the wait ends when the window has no mark (a new
    document) and is loaded; while the page changes, the driver's errors only mean "not yet"
    (chromium answers some of them as "Node ... does not belong to the document", not as stale)."""
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    driver.execute_script("window.__serveAppOldPage = true")
    button.click()
    WebDriverWait(driver, 20, ignored_exceptions=(WebDriverException,)).until(
        lambda d: d.execute_script("return window.__serveAppOldPage === undefined "
                                   "&& document.readyState === 'complete'"))


def sign_in(driver: Any, url: str, key: str) -> None:
    """Sign in to the console at ``url`` (the gateway's root) with ``key``, as a user types it."""
    from selenium.webdriver.common.by import By

    driver.get(url + "/console/signin")
    driver.find_element(By.CSS_SELECTOR, "label[for=key]")  # the field is labelled
    driver.find_element(By.ID, "key").send_keys(key)
    click_and_wait(driver, driver.find_element(By.CSS_SELECTOR, "form button[type=submit]"))
