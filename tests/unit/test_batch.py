"""The Batch API without Ray: input parsing and validation, the state machine, the stores, the
runner (retries, cancel, resume after a crash) and the SDK's own flow over the gateway's routes."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types import Batch as SDKBatch

from serve_app import errors
from serve_app.batch.batches import (
    BadTransition,
    Batch,
    BatchStore,
    check_create,
    parse_input,
    parse_line,
)
from serve_app.batch.routes import BatchService
from serve_app.batch.runner import BatchRunner
from serve_app.config import AppConfig, KeyRecord
from serve_app.protocol import Answer, Endpoint
from serve_app.state.batches import FileBatchStore, RedisBatchStore
from serve_app.state.connections import Connections
from serve_app.state.files import FileStore, ResultFile
from tests.unit.test_api import Env

URL = "/v1/chat/completions"
CFG = AppConfig.model_validate({
    "models": [{"id": "tiny-chat", "source": "builtin:tiny-chat"}],
    "tiers": {"premium": {"priority": 0}, "batch": {"priority": 10}},
    "default_tier": "premium",
    "gateway": {"batch": {"concurrency": 3, "lease_s": 3.0, "backoff_max_s": 0.05}},
})
KEY = KeyRecord(id="owner", digest="sha256:" + "0" * 64, tier="premium")


def line(cid: str, **over: Any) -> bytes:
    obj = {"custom_id": cid, "method": "POST", "url": URL,
           "body": {"model": "tiny-chat", "messages": [{"role": "user", "content": cid}]}}
    obj.update(over)
    return json.dumps(obj).encode()


# ---- parsing and validation ---------------------------------------------------------------------
@pytest.mark.parametrize(("raw", "why"), [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "not a JSON object"),
    (json.dumps({"method": "POST", "url": URL, "body": {}}).encode(), "custom_id"),
    (line("a", method="GET"), "method"),
    (line("a", url="/v1/embeddings"), "url"),
    (line("a", body=[1]), "body must be"),
    (line("a", body={"model": "m", "stream": True}), "stream"),
    (line("a", body={"messages": []}), "model"),
    (line("a", body={"model": "m", "n": 2**70}), "out of range"),
])
def test_malformed_line_says_why(raw: bytes, why: str) -> None:
    parsed = parse_line(3, raw, URL)
    assert parsed.body is None and parsed.error is not None and why in parsed.error


@pytest.mark.parametrize(("raw", "why"), [
    # What the HTTP API refuses, a line refuses too (issue 36): a field the gateway owns ...
    (line("a", body={"model": "m", "messages": [], "api_base": "http://evil"}), "'api_base' is not"),
    # ... nesting deeper than the HTTP parser's limit (json.loads would recurse) ...
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", '
     b'"x": ' + b"[" * 200 + b"]" * 200 + b"}}", "nested deeper"),
])
def test_a_line_passes_the_http_apis_body_rules(raw: bytes, why: str) -> None:
    parsed = parse_line(3, raw, URL)
    assert parsed.body is None and parsed.error is not None and why in parsed.error


def test_a_line_over_the_http_body_limit_is_refused() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]}
    assert parse_line(1, line("a", body=body), URL, max_body_bytes=4096).error is None
    parsed = parse_line(1, line("a", body=body), URL, max_body_bytes=1024)
    assert parsed.body is None and "over the limit of 1024 bytes" in (parsed.error or "")


def test_good_line_parses() -> None:
    parsed = parse_line(1, line("req-1"), URL)
    assert parsed.error is None and parsed.custom_id == "req-1" and parsed.body is not None


@pytest.mark.parametrize(("data", "code"), [
    (b"\n  \n", "empty_file"),
    (line("a") + b"\n" + line("a"), "duplicate_custom_id"),
    (b"\n".join(line(str(i)) for i in range(6)), "too_many_requests"),
])
def test_unusable_file_fails_the_batch(data: bytes, code: str) -> None:
    _, fatal = parse_input(data, URL, max_lines=5)
    assert [e["code"] for e in fatal] == [code]


def test_malformed_lines_do_not_fail_the_batch() -> None:
    lines, fatal = parse_input(line("a") + b"\n{oops\n\n" + line("b"), URL, max_lines=5)
    assert not fatal
    assert [(ln.number, ln.error is None) for ln in lines] == [(1, True), (2, False), (4, True)]


@pytest.mark.parametrize(("body", "param"), [
    ({"endpoint": URL, "completion_window": "24h"}, "input_file_id"),
    ({"input_file_id": "f", "endpoint": "/v1/completions", "completion_window": "24h"}, "endpoint"),
    ({"input_file_id": "f", "endpoint": [URL], "completion_window": "24h"}, "endpoint"),
    ({"input_file_id": "f", "endpoint": URL, "completion_window": {}}, "completion_window"),
    ({"input_file_id": "f", "endpoint": URL, "completion_window": "1h"}, "completion_window"),
    ({"input_file_id": "f", "endpoint": URL, "completion_window": "24h", "metadata": {"a": 1}},
     "metadata"),
])
def test_create_body_is_checked(body: dict[str, Any], param: str) -> None:
    with pytest.raises(errors.InvalidRequest) as exc:
        check_create(body)
    assert exc.value.param == param


# ---- the state machine --------------------------------------------------------------------------
def _batch(**over: Any) -> Batch:
    fields: dict[str, Any] = dict(
        id="batch-1", endpoint=URL, input_file_id="file-in", completion_window="24h",
        created_at=100, expires_at=100 + 86400, owner="owner", key_id="owner",
        output_path="file-out", error_path="file-err")
    fields.update(over)
    return Batch(**fields)


def test_state_machine_allows_openais_transitions_only() -> None:
    b = _batch()
    for status in ("in_progress", "finalizing", "completed"):
        b.move(status, 200)
    assert b.completed_at == 200 and b.done
    with pytest.raises(BadTransition):
        b.move("cancelling", 300)
    with pytest.raises(BadTransition):
        _batch().move("completed", 1)  # validating cannot skip to the end


def test_public_object_is_what_the_sdk_reads() -> None:
    b = _batch(total=3, completed=2, failed=1, metadata={"job": "x"})
    sdk = SDKBatch.model_validate(b.public())
    assert sdk.status == "validating" and sdk.request_counts is not None
    assert (sdk.request_counts.total, sdk.request_counts.completed) == (3, 2)
    assert SDKBatch.model_validate(b.public(cancel_requested=True)).status == "cancelling"
    assert Batch.from_json(b.to_json()) == b


# ---- the stores ---------------------------------------------------------------------------------
def test_result_file_drops_a_torn_line_and_knows_what_is_written(tmp_path: Path) -> None:
    p = tmp_path / "out"
    p.write_bytes(b'{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_id": "c", "respo')
    f = ResultFile(p)
    assert f.open() == {"a", "b"} and f.lines == 2
    f.append({"custom_id": "c"})
    f.close()
    assert [json.loads(x)["custom_id"] for x in p.read_bytes().splitlines()] == ["a", "b", "c"]


def test_files_belong_to_their_owner(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    f = store.create("alice", "in.jsonl", "batch", b"x\n")
    assert store.get("alice", f["id"])["bytes"] == 2
    for bad in ("bob", "alice"):
        with pytest.raises(errors.NotFound):
            store.get(bad, f["id"] if bad == "bob" else "../" + f["id"])
    assert [o["id"] for o in store.list("alice")] == [f["id"]] and store.list("bob") == []
    assert store.delete("alice", f["id"])["deleted"] is True
    with pytest.raises(errors.NotFound):
        store.content_path("alice", f["id"])


@pytest.mark.parametrize("kind", ["files", "redis"])
def test_store_lease_is_exclusive_and_lapses(kind: str, tmp_path: Path,
                                             request: pytest.FixtureRequest) -> None:
    async def go() -> None:
        conns = Connections(request.getfixturevalue("redis_url") if kind == "redis" else None, None)
        store = BatchStore(FileBatchStore(tmp_path) if kind == "files"
                           else RedisBatchStore(conns.redis()))
        b = _batch(id=f"batch-{kind}-{time.time_ns()}")
        await store.save(b)
        assert await store.load(b.id) == b and b.id in await store.active()
        assert b.id in [x.id for x in await store.owned("owner")]
        assert b.id in [x.id for x in await store.recent(100)]
        assert await store.claim(b.id, "a", 0.2)
        assert not await store.claim(b.id, "b", 0.2)
        assert await store.claim(b.id, "a", 0.2)  # renewal
        await asyncio.sleep(0.3)
        assert await store.claim(b.id, "b", 5)  # a's lease lapsed
        await store.release(b.id, "a")  # not a's to release
        assert not await store.claim(b.id, "a", 5)
        await store.release(b.id, "b")
        assert await store.claim(b.id, "a", 5)
        assert not await store.cancel_requested(b.id)
        await store.request_cancel(b.id)
        assert await store.cancel_requested(b.id)
        b.move("failed", 1)
        await store.save(b)
        assert b.id not in await store.active()
        await conns.close()

    asyncio.run(go())


# ---- the runner ---------------------------------------------------------------------------------
class FakePipeline:
    """``Pipeline.answer_line`` for the runner: answers each chat body, refusing some first."""

    def __init__(self, refuse_first: int = 0, delay_s: float = 0.0) -> None:
        self.calls: list[tuple[str, str]] = []
        self.refuse = refuse_first
        self.delay_s = delay_s

    async def __call__(self, key: KeyRecord, endpoint: Endpoint, body: dict[str, Any],
                       size: int, arrival: float) -> Answer:
        if self.refuse:
            self.refuse -= 1
            raise errors.Shed("shed", retry_after_s=1)
        cid = body["messages"][0]["content"]
        self.calls.append((cid, key.tier))
        await asyncio.sleep(self.delay_s)
        if cid == "bad-model":
            raise errors.ModelNotFound("The model `nope` does not exist.")
        answer = {"object": "chat.completion", "choices": [{"message": {"content": cid}}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
        return Answer(200, {}, body=json.dumps(answer).encode())


def _setup(tmp_path: Path, data: bytes, pipeline: FakePipeline,
           cfg: AppConfig = CFG) -> tuple[BatchRunner, BatchService, str]:
    files = FileStore(tmp_path)
    store = BatchStore(FileBatchStore(tmp_path))
    runner = BatchRunner(cfg, files, store, pipeline, lambda key_id: KEY)
    service = BatchService(cfg, files, store)
    f = files.create(KEY.owner, "in.jsonl", "batch", data)
    created = asyncio.run(service.create_batch(
        KEY, {"input_file_id": f["id"], "endpoint": URL, "completion_window": "24h"}))
    return runner, service, created["id"]


def _results(runner: BatchRunner, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    raw = runner.files.content_path(KEY.owner, file_id).read_bytes()
    return [json.loads(x) for x in raw.splitlines()]


def test_runner_answers_every_line_at_the_batch_tier(tmp_path: Path) -> None:
    ids = [f"r{i}" for i in range(7)]
    data = b"\n".join([*(line(i) for i in ids), b"{broken", line("bad-model")])
    pipeline = FakePipeline(refuse_first=2)
    runner, service, batch_id = _setup(tmp_path, data, pipeline)
    asyncio.run(runner.run_batch(batch_id))
    got = asyncio.run(service.get_batch(KEY, batch_id))
    assert got["status"] == "completed" and got["completed_at"] and got["in_progress_at"]
    assert got["request_counts"] == {"total": 9, "completed": 7, "failed": 2}
    out = _results(runner, got["output_file_id"])
    assert sorted(r["custom_id"] for r in out) == ids
    assert all(r["response"]["status_code"] == 200 and r["response"]["body"]["choices"][0][
        "message"]["content"] == r["custom_id"] for r in out)
    errs = _results(runner, got["error_file_id"])
    assert {(r["custom_id"], (r["response"] or {}).get("status_code"), bool(r["error"]))
            for r in errs} == {(None, None, True), ("bad-model", 404, False)}
    # The premium key's lines ran at the batch tier (its priority and limits), charged to the key.
    assert {tier for _, tier in pipeline.calls} == {"batch"}
    assert got["usage"]["output_tokens"] == 2 * 7


def test_runner_resumes_without_losing_or_repeating_a_line(tmp_path: Path) -> None:
    """A gateway killed mid-batch: two answers written, the third torn mid-write. The resumed
    run answers only the rest, and the output holds each custom_id once."""
    ids = [f"r{i}" for i in range(6)]
    pipeline = FakePipeline()
    runner, service, batch_id = _setup(tmp_path, b"\n".join(line(i) for i in ids), pipeline)
    b = asyncio.run(runner.store.load(batch_id))
    assert b is not None
    b.move("in_progress", time.time())
    b.total = 6
    asyncio.run(runner.store.save(b))
    done = [json.dumps({"custom_id": c, "response": {"status_code": 200, "body": {}}})
            for c in ("r0", "r3")]
    runner.files.data_path(b.output_path).write_text("\n".join(done) + '\n{"custom_id": "r1", "re')
    runner.files.data_path(b.error_path).write_text("")
    asyncio.run(runner.run_batch(batch_id))
    got = asyncio.run(service.get_batch(KEY, batch_id))
    assert got["status"] == "completed"
    assert sorted(c for c, _ in pipeline.calls) == ["r1", "r2", "r4", "r5"]
    out = [r["custom_id"] for r in _results(runner, got["output_file_id"])]
    assert sorted(out) == ids and len(out) == len(set(out))


def test_cancel_stops_the_batch_and_keeps_finished_lines(tmp_path: Path) -> None:
    ids = [f"r{i}" for i in range(40)]
    pipeline = FakePipeline(delay_s=0.2)
    runner, service, batch_id = _setup(tmp_path, b"\n".join(line(i) for i in ids), pipeline)

    async def go() -> None:
        task = asyncio.create_task(runner.run_batch(batch_id))
        await asyncio.sleep(0.7)
        view = await service.cancel_batch(KEY, batch_id)
        assert view["status"] == "cancelling"
        await asyncio.wait_for(task, 5)

    asyncio.run(go())
    got = asyncio.run(service.get_batch(KEY, batch_id))
    assert got["status"] == "cancelled" and got["cancelled_at"]
    out = _results(runner, got["output_file_id"])
    assert 0 < len(out) < 40 and got["request_counts"]["completed"] == len(out)
    assert len(pipeline.calls) < 40
    with pytest.raises(errors.InvalidRequest):
        asyncio.run(service.cancel_batch(KEY, batch_id))


def test_two_runners_never_run_one_batch(tmp_path: Path) -> None:
    ids = [f"r{i}" for i in range(12)]
    pipeline = FakePipeline(delay_s=0.05)
    first, service, batch_id = _setup(tmp_path, b"\n".join(line(i) for i in ids), pipeline)
    second = BatchRunner(CFG, first.files, first.store, pipeline, lambda key_id: KEY)

    async def go() -> None:
        await first.poll_once()
        await second.poll_once()
        assert list(first.running) == [batch_id] and not second.running
        await asyncio.gather(*first.running.values())

    asyncio.run(go())
    assert sorted(c for c, _ in pipeline.calls) == sorted(ids)  # each line ran once


def test_unusable_input_fails_with_errors(tmp_path: Path) -> None:
    runner, service, batch_id = _setup(tmp_path, line("a") + b"\n" + line("a"), FakePipeline())
    asyncio.run(runner.run_batch(batch_id))
    got = asyncio.run(service.get_batch(KEY, batch_id))
    assert got["status"] == "failed" and got["failed_at"]
    assert got["errors"]["data"][0]["code"] == "duplicate_custom_id"


# ---- the routes, through the openai SDK ---------------------------------------------------------
@pytest.fixture
def api(tmp_path: Path) -> Any:
    e = Env(tmp_path)
    with e.client:
        yield e


def _sdk(env: Env, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=env.client,
                         max_retries=0)


def test_sdk_flow_over_the_routes(api: Env) -> None:
    from tests.unit.test_api import OK_BODY  # what the fake model answers

    client = _sdk(api, api.all_key)
    data = b"\n".join(line(f"r{i}", body={"model": "tiny", "messages": []}) for i in range(3))
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    assert f.purpose == "batch" and f.bytes == len(data)
    assert client.files.content(f.id).content == data
    assert [x.id for x in client.files.list()] == [f.id]
    b = client.batches.create(input_file_id=f.id, endpoint=URL, completion_window="24h",
                              metadata={"job": "unit"})
    assert b.status == "validating" and b.metadata == {"job": "unit"}
    assert [x.id for x in client.batches.list()] == [b.id]
    deps = api.client.app.state.deps  # type: ignore[attr-defined]
    runner = BatchRunner(deps.cfg, deps.batch.files, deps.batch.store, deps.pipeline.answer_line,
                         deps.keys.by_id)
    asyncio.run(runner.run_batch(b.id))
    done = client.batches.retrieve(b.id)
    assert done.status == "completed" and done.output_file_id
    out = [json.loads(x) for x in client.files.content(done.output_file_id).content.splitlines()]
    assert sorted(r["custom_id"] for r in out) == ["r0", "r1", "r2"]
    assert all(r["response"]["body"] == json.loads(OK_BODY) for r in out)
    # Another key sees none of it.
    other = _sdk(api, api.chat_key)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(b.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(f.id)
    assert client.files.delete(f.id).deleted


@pytest.mark.parametrize(("kw", "status", "param"), [
    ({"files": {"purpose": (None, "batch")}}, 400, "file"),
    ({"data": {"purpose": "fine-tune"}, "files": {"file": ("a.jsonl", b"x")}}, 400, "purpose"),
    ({"data": {"purpose": "batch"}, "files": {"file": ("a.jsonl", b"")}}, 400, "file"),
    ({"data": {"purpose": "batch"}, "files": {"file": ("a.jsonl", b"\xff\xfe")}}, 400, "file"),
    ({"content": b"{}", "headers": {"content-type": "application/json"}}, 415, None),
    ({"content": b"--x\r\nbroken", "headers": {"content-type": "multipart/form-data; boundary=x"}},
     400, "file"),
])
def test_bad_uploads_are_openai_errors(api: Env, kw: dict[str, Any], status: int,
                                       param: str | None) -> None:
    headers = {"Authorization": f"Bearer {api.all_key}", **kw.pop("headers", {})}
    resp = api.client.post("/v1/files", headers=headers, **kw)
    assert resp.status_code == status, resp.text
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert resp.json()["error"]["param"] == param


def test_upload_over_the_limit_is_413(tmp_path: Path) -> None:
    e = Env(tmp_path)
    deps = e.client.app.state.deps  # type: ignore[attr-defined]
    cfg = deps.cfg.model_copy(update={"gateway": deps.cfg.gateway.model_copy(update={
        "batch": deps.cfg.gateway.batch.model_copy(update={"max_file_bytes": 100})})})
    deps.batch.cfg = cfg
    with e.client:
        resp = e.client.post("/v1/files", headers={"Authorization": f"Bearer {e.all_key}"},
                             data={"purpose": "batch"}, files={"file": ("a", b"x" * 200_000)})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_batch_routes_need_a_key_and_known_ids(api: Env) -> None:
    assert api.get("/v1/batches").status_code == 401
    assert api.get("/v1/files/file-nope", api.all_key).status_code == 404
    assert api.get("/v1/batches/../../etc", api.all_key).status_code == 404
    resp = api.post("/v1/batches", {"input_file_id": "file-nope", "endpoint": URL,
                                    "completion_window": "24h"}, api.all_key)
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "file_id"
    resp = api.post("/v1/batches", {"input_file_id": "f", "endpoint": URL,
                                    "completion_window": "2h"}, api.all_key)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "completion_window"
    assert api.get("/v1/files?limit=0", api.all_key).status_code == 400


def test_batch_tier_defaults_to_the_lowest_priority() -> None:
    cfg = AppConfig.model_validate({"models": [{"id": "m", "source": "x"}],
                                    "tiers": {"standard": {"priority": 1}, "bulk": {"priority": 9}}})
    assert cfg.batch_tier == "bulk"
    with pytest.raises(ValueError, match="gateway.batch.tier"):
        AppConfig.model_validate({"models": [{"id": "m", "source": "x"}],
                                  "gateway": {"batch": {"tier": "nope"}}})



def test_a_batch_of_only_malformed_lines_completes(tmp_path: Path) -> None:
    runner, service, batch_id = _setup(tmp_path, b"{x\n" + line("a", method="GET"), FakePipeline())
    asyncio.run(runner.run_batch(batch_id))
    got = asyncio.run(service.get_batch(KEY, batch_id))
    assert got["status"] == "completed" and got["output_file_id"] is None
    assert got["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    assert len(_results(runner, got["error_file_id"])) == 2
