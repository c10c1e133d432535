"""Fixtures shared by unit and integration tests: a real redis-server on loopback."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from serve_app.local.redis_server import LocalStateError, start_local_redis

# Ray caches its config when it is imported. The integration tests' driver connects to the session
# stack's cluster by its address, and a cluster that ray.init() starts uses token auth, which an
# explicit address does not switch on: so token mode is set here, before anything imports ray.
os.environ.setdefault("RAY_AUTH_MODE", "token")


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
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing: .ci/run must run scripts/system-deps.sh")
        pytest.skip("redis-server is not installed (run scripts/system-deps.sh)")
    try:
        redis = start_local_redis(tmp_path_factory.mktemp("redis"))
    except LocalStateError as exc:
        pytest.fail(str(exc))
    try:
        yield redis.url
    finally:
        redis.stop()
