"""Fixtures shared by unit and integration tests: a real redis-server on loopback."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

# Ray caches its config when it is imported. The integration tests' driver connects to the session
# stack's cluster by its address, and a cluster that ray.init() starts uses token auth, which an
# explicit address does not switch on: so token mode is set here, before anything imports ray.
os.environ.setdefault("RAY_AUTH_MODE", "token")


def in_ci() -> bool:
    """True on CI (``.ci/run`` exports CI=1; hosted runners set CI=true): a missing service there
    is a broken machine, not a reason to skip."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Under CI every skip is a failure (an expected failure, ``xfail``, stays one): a skip there
    would hide that a service the test needs (redis-server, prometheus, chromium, an agent CLI)
    was never installed, and the suite would pass without testing it."""
    report: pytest.TestReport = yield
    if report.skipped and in_ci() and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, which must not skip: {reason}"
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``faults`` or ``soak`` kill processes of the session stack (which recovers,
    but slowly): they run after every other test, in their files' order; a test marked
    ``stops_stack`` stops it, so it runs last of all."""
    def rank(item: pytest.Item) -> int:
        if item.get_closest_marker("stops_stack"):
            return 3
        if item.get_closest_marker("soak"):
            return 2
        return 1 if item.get_closest_marker("faults") else 0

    items.sort(key=rank)  # stable: the order within each group is kept


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server (installed by scripts/system-deps.sh), bound to 127.0.0.1."""
    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing: .ci/run must run scripts/system-deps.sh")
        pytest.skip("redis-server is not installed (run scripts/system-deps.sh)")
    port = free_port()
    workdir: Path = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
