"""Fixtures shared by unit and integration tests: a real redis-server on loopback."""

from __future__ import annotations

import os
import shutil
from collections.abc import Generator, Iterator

import pytest

from serve_app.local.redis_server import LocalStateError, start_local_redis

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


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server (installed by scripts/system-deps.sh), bound to 127.0.0.1, started as
    ``serve-app run`` starts its own: ready means PING answers PONG, not only an open port."""
    if shutil.which("redis-server") is None:  # a failure under CI (pytest_runtest_makereport)
        pytest.skip("redis-server is not installed (run scripts/system-deps.sh)")
    try:
        redis = start_local_redis(tmp_path_factory.mktemp("redis"))
    except LocalStateError as exc:
        pytest.fail(str(exc))
    try:
        yield redis.url
    finally:
        redis.stop()
