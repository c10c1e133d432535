"""The console in headless chromium against the real stack (the session ``stack``: Ray Serve, the
vLLM CPU engine, Redis, two gateway replicas behind the HAProxy front door).

An admin key made by ``serve-app keys create --role admin`` signs in; a client key is created in
the console; real chat requests with it (openai SDK) raise the console's usage count to what
``GET /admin/v1/usage`` says; revoked in the console, the key is refused with 401; and a client
key cannot open the console. The session cookie is taken to each gateway replica's own port: it
is good on both, because they sign with the one secret kept in Redis (``state/secrets.py``)."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loadtests.harness.faults import find_replicas
from loadtests.harness.stack import CLI, ROOT, Stack
from serve_app.app import GATEWAY_DEPLOYMENT
from serve_app.gateway.http.console_session import COOKIE
from tests.browser.chrome import click_and_wait, running_chrome, sign_in
from tests.integration.conftest import GATEWAY_REPLICAS

pytestmark = pytest.mark.integration

REQUESTS = 3
CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}


def _chat(client: openai.OpenAI) -> Any:
    return client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)


def _auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def _listening(pid: int) -> list[str]:
    """The ``host:port`` of every TCP socket a process listens on (its fds' socket inodes in its
    network namespace's tables)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = cols[1].rsplit(":", 1)
            ip = ipaddress.ip_address(bytes.fromhex(addr)[::-1]) if len(addr) == 8 else None
            host = "127.0.0.1" if ip is None or ip.is_unspecified else str(ip)
            found.append(f"{host}:{int(port, 16)}")
    return found


def gateway_urls(stack: Stack) -> list[str]:
    """Each gateway replica's own HTTP address (direct ingress: HAProxy balances over them)."""
    pids = find_replicas(stack.proc.pid, GATEWAY_DEPLOYMENT)
    assert len(pids) == GATEWAY_REPLICAS, pids
    urls = []
    for pid in pids:
        http = [f"http://{a}" for a in _listening(pid)
                if _status(f"http://{a}/console/signin") == 200]
        assert len(http) == 1, (pid, _listening(pid))
        urls.append(http[0])
    return urls


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _until(what: str, check: Any, timeout_s: float = 20.0) -> Any:
    """Poll ``check()`` until it returns something true; its last value."""
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.2)
    return got


@pytest.fixture(scope="module")
def admin_key(stack: Stack) -> str:
    """An admin key made with ``serve-app keys create --role admin`` in the stack's keys file,
    once every gateway replica has read it."""
    done = subprocess.run([*CLI, "keys", "create", "--config", str(stack.config), "--id",
                           f"console-root-{uuid.uuid4().hex[:6]}", "--role", "admin"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    secret = done.stdout.strip().splitlines()[-1]
    for url in gateway_urls(stack):
        _until(f"{url} knows the admin key", lambda u=url: httpx.get(
            f"{u}/admin/v1/keys", headers=_auth(secret), timeout=10).status_code == 200)
    return secret


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    with running_chrome(tmp_path) as driver:
        yield driver


def _usage_count(browser: Any, root: str, key_id: str) -> int:
    """The requests cell of ``key_id``'s row on the console's usage page, loaded afresh."""
    from selenium.webdriver.common.by import By

    browser.get(f"{root}/console/usage?key_id={key_id}")
    row = browser.find_element(By.XPATH, f"//tbody/tr[th[@scope='row' and text()='{key_id}']]")
    return int(row.find_elements(By.TAG_NAME, "td")[0].text)


def _admin_count(root: str, admin: str, key_id: str) -> int:
    r = httpx.get(f"{root}/admin/v1/usage", params={"key_id": key_id}, headers=_auth(admin), timeout=10)
    assert r.status_code == 200, r.text
    return int(r.json()["requests"])


def test_console_keys_usage_and_revoke_on_the_real_stack(stack: Stack, admin_key: str,
                                                         browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    root = stack.root_url
    sign_in(browser, root, admin_key)
    assert browser.current_url.endswith("/console/keys"), browser.page_source[:2000]
    cookie = browser.get_cookie(COOKIE)
    assert cookie is not None and cookie["httpOnly"] is True

    # One session, both replicas: each signs and checks with the secret kept in Redis.
    for url in gateway_urls(stack):
        page = httpx.get(f"{url}/console/keys", cookies={COOKIE: cookie["value"]}, timeout=10,
                         follow_redirects=False)
        assert page.status_code == 200 and "<h1>Keys</h1>" in page.text, (url, page.status_code)

    key_id = f"web-{uuid.uuid4().hex[:6]}"
    browser.find_element(By.ID, "id").send_keys(key_id)
    Select(browser.find_element(By.ID, "tier")).select_by_value("standard")
    browser.find_element(By.ID, "models").send_keys("tiny-chat")
    click_and_wait(browser, browser.find_element(By.XPATH, "//button[text()='Create key']"))
    secret = browser.find_element(By.ID, "new-secret").text
    assert secret.startswith("sk-sa-")
    row = browser.find_element(By.XPATH, f"//tr[th[@scope='row' and text()='{key_id}']]")
    assert "standard" in row.text and "active" in row.text
    stack.wait_keys(accepted=[secret], timeout_s=10)  # both replicas read the keys file

    assert _usage_count(browser, root, key_id) == 0 == _admin_count(root, admin_key, key_id)
    client = openai.OpenAI(base_url=stack.base_url, api_key=secret, max_retries=0, timeout=120)
    for _ in range(REQUESTS):
        answer = _chat(client)
        assert answer.usage is not None and answer.usage.completion_tokens > 0
    # usage is written when each request ends: reload the page until it shows them all
    shown = _until("the usage page shows the requests",
                   lambda: (n := _usage_count(browser, root, key_id)) >= REQUESTS and n)
    assert shown == REQUESTS == _admin_count(root, admin_key, key_id)

    browser.get(f"{root}/console/keys")
    row = browser.find_element(By.XPATH, f"//tr[th[@scope='row' and text()='{key_id}']]")
    click_and_wait(browser, row.find_element(By.XPATH, ".//button[text()='Revoke']"))
    row = browser.find_element(By.XPATH, f"//tr[th[@scope='row' and text()='{key_id}']]")
    assert "revoked" in row.text
    waited = stack.wait_keys(rejected=[secret], timeout_s=10)
    print(f"\n[console] revoke refused on both replicas after {waited:.2f} s")
    with pytest.raises(openai.AuthenticationError) as refused:
        _chat(client)
    assert refused.value.status_code == 401
    for url in gateway_urls(stack):  # and on each replica's own port
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=_auth(secret), timeout=30)
        assert r.status_code == 401, (url, r.text)


def test_a_client_key_cannot_open_the_console(stack: Stack, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    client_key = stack.keys["all"]
    sign_in(browser, stack.root_url, client_key)
    assert "Sign-in refused" in browser.find_element(By.CSS_SELECTOR, "[role=alert]").text
    assert browser.get_cookie(COOKIE) is None
    browser.get(stack.root_url + "/console/keys")
    assert browser.current_url.endswith("/console/signin")
    for url in gateway_urls(stack):  # no replica signs it in, none lets it change a key
        r = httpx.post(f"{url}/console/signin", data={"key": client_key}, timeout=10,
                       follow_redirects=False)
        assert r.status_code == 401 and "set-cookie" not in r.headers
        r = httpx.post(f"{url}/console/keys", data={"id": "sneaky"}, headers=_auth(client_key),
                       timeout=10, follow_redirects=False)
        assert r.status_code == 403
