"""OpenAI's Batch API on the session stack, through the openai SDK's own calls: files.create ->
batches.create -> poll batches.retrieve -> files.content, for chat and embeddings; malformed lines
in the error file; cancel; and a SIGKILL of the gateway replica that runs a batch, after which the
output still holds every custom_id exactly once."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections import Counter
from typing import Any

import openai
import pytest
import redis

from loadtests.harness.faults import alive, find_replicas
from tests.keys import create_key

pytestmark = pytest.mark.integration

CHAT_URL = "/v1/chat/completions"
EMBED_URL = "/v1/embeddings"


def _line(cid: str, url: str = CHAT_URL, **body: Any) -> dict[str, Any]:
    if url == EMBED_URL:
        payload: dict[str, Any] = {"model": "minilm-embed", "input": f"text {cid}"}
    else:
        payload = {"model": "tiny-chat", "max_tokens": 8,
                   "messages": [{"role": "user", "content": f"say {cid}"}]}
    payload.update(body)
    return {"custom_id": cid, "method": "POST", "url": url, "body": payload}


def _jsonl(items: list[Any]) -> bytes:
    return b"\n".join(i if isinstance(i, bytes) else json.dumps(i).encode() for i in items) + b"\n"


@pytest.fixture(scope="module")
def sdk(stack: Any) -> openai.OpenAI:
    """A premium key of its own (its lines run at the batch tier), so no other test's limits
    are touched. A fresh id each time: the SIGKILL test runs at the session's end (it stops the
    stack), in a second instance of this module fixture."""
    secret = create_key(stack.keys_file, f"batch-user-{uuid.uuid4().hex[:8]}", "premium", ["*"])
    stack.wait_keys(accepted=[secret])
    return openai.OpenAI(base_url=stack.base_url, api_key=secret, max_retries=2)


def _submit(sdk: openai.OpenAI, items: list[Any], url: str = CHAT_URL) -> str:
    f = sdk.files.create(file=("batch.jsonl", _jsonl(items)), purpose="batch")
    b = sdk.batches.create(input_file_id=f.id, endpoint=url,  # type: ignore[arg-type]
                           completion_window="24h")
    assert b.status == "validating" and b.input_file_id == f.id
    return b.id


def _wait(sdk: openai.OpenAI, batch_id: str, until: Any, timeout_s: float = 300.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        b = sdk.batches.retrieve(batch_id)
        if until(b):
            return b
        assert time.monotonic() < deadline, f"batch {batch_id} stuck at {b.status} {b.request_counts}"
        time.sleep(0.5)


def _final(sdk: openai.OpenAI, batch_id: str, timeout_s: float = 300.0) -> Any:
    return _wait(sdk, batch_id, lambda b: b.status in ("completed", "failed", "cancelled",
                                                        "expired"), timeout_s)


def _records(sdk: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in sdk.files.content(file_id).content.splitlines()]


def test_chat_batch_with_malformed_lines_completes(sdk: openai.OpenAI) -> None:
    ids = [f"chat-{i}" for i in range(20)]
    items: list[Any] = [_line(i) for i in ids]
    items += [b"{not json", _line("wrong-url", url=EMBED_URL), _line("no-such-model", model="nope")]
    b = _final(sdk, _submit(sdk, items))
    assert b.status == "completed", b
    assert b.request_counts is not None
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (23, 20, 3)
    out = _records(sdk, b.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(ids)
    for r in out:
        assert r["response"]["status_code"] == 200
        assert r["response"]["body"]["object"] == "chat.completion"
        assert r["response"]["body"]["usage"]["completion_tokens"] > 0
    errs = _records(sdk, b.error_file_id)
    assert sorted(str(r["custom_id"]) for r in errs) == ["None", "no-such-model", "wrong-url"]
    assert next(r for r in errs if r["custom_id"] == "no-such-model")["response"]["status_code"] == 404
    assert b.usage is not None and b.usage.output_tokens > 0
    assert b.id in [x.id for x in sdk.batches.list(limit=100)]


def test_embeddings_batch(sdk: openai.OpenAI) -> None:
    ids = [f"emb-{i}" for i in range(10)]
    b = _final(sdk, _submit(sdk, [_line(i, url=EMBED_URL) for i in ids], url=EMBED_URL))
    assert b.status == "completed" and b.error_file_id is None, b
    out = _records(sdk, b.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(ids)
    assert all(len(r["response"]["body"]["data"][0]["embedding"]) == 384 for r in out)


def test_cancel_stops_the_batch_and_keeps_finished_lines(sdk: openai.OpenAI) -> None:
    ids = [f"cancel-{i}" for i in range(150)]
    batch_id = _submit(sdk, [_line(i, max_tokens=32) for i in ids])
    _wait(sdk, batch_id, lambda b: b.request_counts is not None and b.request_counts.completed >= 3)
    assert sdk.batches.cancel(batch_id).status == "cancelling"
    b = _final(sdk, batch_id, timeout_s=60)
    assert b.status == "cancelled" and b.cancelled_at, b
    out = _records(sdk, b.output_file_id)
    got = [r["custom_id"] for r in out]
    assert 3 <= len(got) < len(ids) and len(got) == len(set(got))
    assert b.request_counts is not None and b.request_counts.completed == len(got)


@pytest.mark.faults
def test_sigkill_of_the_running_gateway_loses_and_repeats_no_line(
        stack: Any, sdk: openai.OpenAI, redis_url: str) -> None:
    """The replica that holds the batch's lease is killed mid-batch; the batch resumes on a
    replica once the lease lapses (gateway.batch.lease_s), and the output file has every
    custom_id exactly once."""
    ids = [f"kill-{i}" for i in range(120)]
    batch_id = _submit(sdk, [_line(i, max_tokens=16) for i in ids])
    before = _wait(sdk, batch_id,
                   lambda b: b.request_counts is not None and b.request_counts.completed >= 10)
    holder = redis.Redis.from_url(redis_url).get(f"serve_app:batch:lease:{batch_id}")
    assert holder is not None, "no runner holds the batch"
    pid = int(holder.decode().split(":")[1])
    assert pid in find_replicas(stack.proc.pid, "gateway"), (pid, holder)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while alive(pid):
        time.sleep(0.1)
    b = _final(sdk, batch_id, timeout_s=420)
    print(f"\n[batch] killed the runner at {before.request_counts.completed}/120 lines; "
          f"resumed and finished {time.monotonic() - killed_at:.0f} s later")
    assert b.status == "completed", b
    got = Counter(r["custom_id"] for r in _records(sdk, b.output_file_id))
    got.update(r["custom_id"] for r in _records(sdk, b.error_file_id))
    assert set(got) == set(ids) and set(got.values()) == {1}, got.most_common(3)
