"""API4 (unrestricted resource consumption) on the Batch API: unfinished batches per key and per
owner, and files per owner, are bounded (issue 36: only file size and lines per file were)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from serve_app.gateway.keys.ops import KeyOps
from tests.keys import run
from tests.unit.test_admin_api import Admin

LINE = (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
        b'"body": {"model": "tiny", "messages": []}}')


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Admin]:
    a = Admin(tmp_path, gateway={"batch": {"max_open_batches_per_key": 2,
                                           "max_open_batches_per_owner": 3,
                                           "max_files_per_owner": 4}})
    with a.client:
        yield a


def _sdk(env: Admin, key_id: str, **fields: str) -> openai.OpenAI:
    secret = run(KeyOps(env.deps.keys).create(key_id, **fields)).secret
    return openai.OpenAI(base_url="http://testserver/v1", api_key=secret, http_client=env.client,
                         max_retries=0)


def test_open_batches_are_bounded_per_key_and_per_owner(env: Admin) -> None:
    a, b = _sdk(env, "a", tenant="acme"), _sdk(env, "b", tenant="acme")
    f = a.files.create(file=("in.jsonl", LINE), purpose="batch")
    g = b.files.create(file=("in.jsonl", LINE), purpose="batch")

    def create(client: openai.OpenAI, file_id: str) -> None:
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                              completion_window="24h")

    create(a, f.id)
    create(a, f.id)
    with pytest.raises(openai.RateLimitError) as err:
        create(a, f.id)  # the key's third
    assert err.value.code == "too_many_open_batches"
    create(b, g.id)  # the tenant's third
    with pytest.raises(openai.RateLimitError):
        create(b, g.id)  # the tenant's fourth, the key's second


def test_files_are_bounded_per_owner(env: Admin) -> None:
    a = _sdk(env, "a")
    made = [a.files.create(file=("in.jsonl", LINE), purpose="batch") for _ in range(4)]
    with pytest.raises(openai.RateLimitError) as err:
        a.files.create(file=("in.jsonl", LINE), purpose="batch")
    assert err.value.code == "too_many_files"
    a.files.delete(made[0].id)
    a.files.create(file=("in.jsonl", LINE), purpose="batch")  # room again
    _sdk(env, "b").files.create(file=("in.jsonl", LINE), purpose="batch")  # another owner's own


def test_the_file_batch_store_never_scans_its_folder_on_the_event_loop(tmp_path: Path) -> None:
    """Issue 36: without redis-server, the runner's poll rescanned every batch document on the
    event loop every 2 s; the scans (active, owned, recent) run in a worker thread."""
    import asyncio
    import threading

    from serve_app.state.batches import FileBatchStore

    store = FileBatchStore(tmp_path)
    scanned_on: list[int] = []
    scan = store._all

    def spy() -> Any:
        scanned_on.append(threading.get_ident())
        return scan()

    store._all = spy  # type: ignore[method-assign]

    async def go() -> int:
        for i in range(50):
            await store.save(f"batch-{i:04d}", "key:a", i, False,
                             f'{{"id": "batch-{i:04d}", "owner": "key:a", "created_at": {i}}}')
        assert len(await store.active()) == 50
        assert len(await store.owned("key:a")) == 50 and len(await store.recent(5)) == 5
        return threading.get_ident()

    loop_thread = asyncio.run(go())
    assert len(scanned_on) == 3 and loop_thread not in scanned_on
