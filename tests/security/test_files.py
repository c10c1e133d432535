"""A user can delete their own data, through the front door too, but not a file a running batch
reads; uploads are readable by the gateway's user only (issue 36)."""

from __future__ import annotations

import http.client
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from serve_app.gateway.keys.ops import KeyOps
from tests.keys import run
from tests.unit.test_admin_api import Admin
from tests.unit.test_front_door import start_haproxy

LINE = (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
        b'"body": {"model": "tiny", "messages": []}}')


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Admin]:
    a = Admin(tmp_path)
    with a.client:
        yield a


def test_a_file_read_by_a_running_batch_cannot_be_deleted_then_can(env: Admin) -> None:
    sdk = openai.OpenAI(base_url="http://testserver/v1", http_client=env.client, max_retries=0,
                        api_key=run(KeyOps(env.deps.keys).create("u")).secret)
    f = sdk.files.create(file=("in.jsonl", LINE), purpose="batch")
    batch = sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    with pytest.raises(openai.ConflictError) as err:
        sdk.files.delete(f.id)
    assert batch.id in str(err.value)
    sdk.batches.cancel(batch.id)
    run(env.deps.batch.store.save(_done(run(env.deps.batch.store.load(batch.id)))))
    assert sdk.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(f.id)


def _done(b: object) -> object:
    b.status = "cancelled"  # type: ignore[attr-defined]  # what the runner does at its next tick
    return b


def test_uploads_are_private_to_the_gateways_user(env: Admin) -> None:
    sdk = openai.OpenAI(base_url="http://testserver/v1", http_client=env.client, max_retries=0,
                        api_key=run(KeyOps(env.deps.keys).create("u")).secret)
    f = sdk.files.create(file=("in.jsonl", LINE), purpose="batch")
    files = env.deps.batch.files
    for path in (files.data_path(f.id), files._meta_path(f.id)):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(files.dir.stat().st_mode) & 0o077 == 0


def test_the_front_door_lets_delete_through_to_a_file_only(tmp_path: Path) -> None:
    """The real HAProxy with the project's rules; the backend answers 200 from HAProxy itself."""
    echo = "http-request return status 200 content-type text/plain string reached"
    port, proc = start_haproxy(tmp_path, echo)
    statuses = {}
    try:
        for method, path in [("DELETE", "/v1/files/file-abc"), ("DELETE", "/v1/models"),
                             ("DELETE", "/v1/files/file-abc/content"), ("PUT", "/v1/files/x"),
                             ("DELETE", "/admin/v1/keys/k")]:
            for _ in range(100):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                try:
                    conn.request(method, path)
                    statuses[(method, path)] = conn.getresponse().status
                    break
                except OSError:
                    time.sleep(0.05)
                finally:
                    conn.close()
    finally:
        proc.kill()
        proc.wait()
    assert statuses == {("DELETE", "/v1/files/file-abc"): 200, ("DELETE", "/v1/models"): 405,
                        ("DELETE", "/v1/files/file-abc/content"): 405, ("PUT", "/v1/files/x"): 405,
                        ("DELETE", "/admin/v1/keys/k"): 200}

