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
    """Click a link or a form's button and wait for the next page: a click may return before the
    browser has left the old page, and an element found then is gone a moment later (stale)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    old = driver.find_element(By.TAG_NAME, "html")
    button.click()
    WebDriverWait(driver, 20).until(expected_conditions.staleness_of(old))


def sign_in(driver: Any, url: str, key: str) -> None:
    """Sign in to the console at ``url`` (the gateway's root) with ``key``, as a user types it."""
    from selenium.webdriver.common.by import By

    driver.get(url + "/console/signin")
    driver.find_element(By.CSS_SELECTOR, "label[for=key]")  # the field is labelled
    driver.find_element(By.ID, "key").send_keys(key)
    click_and_wait(driver, driver.find_element(By.CSS_SELECTOR, "form button[type=submit]"))
