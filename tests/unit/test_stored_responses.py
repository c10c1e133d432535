"""Stored Responses over HTTP (TestClient, real key store and pipeline, fake model side): store by
default, previous_response_id unrolled into the model's input, GET/DELETE/input_items, background
runs (replay from starting_after, cancel, a revoked key, a dead replica's run)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from serve_app.config import ResponsesConfig
from serve_app.gateway.responses.chain import EventSplitter, event_data, event_kind
from serve_app.gateway.responses.service import StoredResponses
from serve_app.protocol import head, tokens_of, trailer
from serve_app.state.responses import MemoryResponseStore
from tests.keys import revoke_key, run
from tests.unit.fakes import HANG, FakeClient, FakeStream
from tests.unit.test_api import Env, _error

CFG = ResponsesConfig(heartbeat_s=0.05, stale_after_s=1.0)


def response(rid: str, text: str = "hello", status: str = "completed") -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": 1, "status": status, "model": "tiny-chat",
            "store": False, "previous_response_id": None, "background": False,
            "output": [] if status != "completed" else [
                {"id": f"msg_{rid}", "type": "message", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5}}


def sse(kind: str, seq: int, **data: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **data})}\n\n".encode()


def stream_items(rid: str, deltas: int = 3, hang: bool = False) -> list[Any]:
    """A Responses stream as the model replica sends it: created, deltas, completed."""
    first = sse("response.created", 0, response=response(rid, status="in_progress"))
    items: list[Any] = [head(200, first, stream=True, tokens=tokens_of(3, 0))]
    for i in range(deltas):
        items.append((sse("response.output_text.delta", 1 + i, delta=f"w{i} "), i + 1))
    if hang:
        items.append(HANG)
        return items
    items.append((sse("response.completed", 1 + deltas, response=response(rid, "w0 w1 w2")),
                  deltas))
    items.append(trailer(3, deltas))
    return items


class StoredEnv(Env):
    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        from tests.keys import create_key

        self.other_key = create_key(self.keys_file, "other", "premium", ["*"], tenant="acme")
        self.mate_key = create_key(self.keys_file, "mate", "premium", ["*"])
        run(self.keys.refresh(force=True))
        self.deps = self.client.app.state.deps  # type: ignore[attr-defined]
        self.store = MemoryResponseStore()
        self.deps.responses = StoredResponses(self.store, CFG, self.keys.by_id)

    def answer(self, items: list[Any]) -> None:
        self.models.items = items

    def create(self, key: str | None = None, **body: Any) -> dict[str, Any]:
        r = self.post("/v1/responses", {"model": "tiny-chat", "input": "hi", **body},
                      key=key or self.all_key)
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[StoredEnv]:
    e = StoredEnv(tmp_path)
    with e.client:
        yield e


def test_a_response_is_stored_by_default_and_read_back(env: StoredEnv) -> None:
    env.answer([head(200, json.dumps(response("resp_a1")).encode(), tokens=tokens_of(3, 2))])
    r = env.create()
    assert r["id"] == "resp_a1" and r["store"] is True
    sent = env.models.calls[0]
    assert sent.body["store"] is False and "previous_response_id" not in sent.body
    assert sent.ctx["request_id"].startswith("resp_")  # the engine's id is OpenAI's shape
    got = env.get("/v1/responses/resp_a1", env.all_key)
    assert got.status_code == 200 and got.json() == r
    items = env.get("/v1/responses/resp_a1/input_items", env.all_key).json()
    assert items["object"] == "list" and len(items["data"]) == 1
    assert items["data"][0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert items["data"][0]["id"].startswith("msg_")


def test_store_false_keeps_nothing(env: StoredEnv) -> None:
    env.answer([head(200, json.dumps(response("resp_a2")).encode())])
    env.create(store=False)
    _error(env.get("/v1/responses/resp_a2", env.all_key), 404, "not_found")


def test_previous_response_id_sends_the_whole_chain(env: StoredEnv) -> None:
    env.answer([head(200, json.dumps(response("resp_t1", "first")).encode())])
    env.create(input="one", instructions="be brief")
    env.answer([head(200, json.dumps(response("resp_t2", "second")).encode())])
    t2 = env.create(input="two", previous_response_id="resp_t1")
    assert t2["previous_response_id"] == "resp_t1"
    env.answer([head(200, json.dumps(response("resp_t3", "third")).encode())])
    env.create(input=[{"role": "user", "content": "three"}], previous_response_id="resp_t2")
    sent = env.models.calls[2].body
    texts = [i["content"] if isinstance(i["content"], str) else i["content"][0]["text"]
             for i in sent["input"]]
    assert texts == ["one", "first", "two", "second", "three"]
    assert "instructions" not in sent  # OpenAI: instructions are not carried over
    # The chain is one session: its turns share the first turn's affinity key, whatever their
    # text, so each goes where the chain's prefix is cached.
    assert len({c.ctx["affinity"] for c in env.models.calls}) == 1
    items = env.get("/v1/responses/resp_t3/input_items?order=asc&limit=2", env.all_key).json()
    assert [i["content"][0]["text"] for i in items["data"]] == ["one", "first"]
    assert items["has_more"] is True
    after = env.get(f"/v1/responses/resp_t3/input_items?order=asc&after={items['last_id']}",
                    env.all_key).json()
    assert [i["content"][0]["text"] for i in after["data"]] == ["two", "second", "three"]


def test_unknown_previous_response_is_400_before_the_model(env: StoredEnv) -> None:
    err = _error(env.post("/v1/responses", {"model": "tiny-chat", "input": "x",
                                            "previous_response_id": "resp_nope"},
                          key=env.all_key), 400, "invalid_request")
    assert err["param"] == "previous_response_id"
    assert env.models.calls == []


def test_a_stream_is_stored_before_its_last_event_goes_out(env: StoredEnv) -> None:
    env.answer(stream_items("resp_s1"))
    with env.client.stream("POST", "/v1/responses", headers={"Authorization": f"Bearer {env.all_key}"},
                           json={"model": "tiny-chat", "input": "hi", "stream": True}) as r:
        events: list[bytes] = []
        splitter = EventSplitter()
        for chunk in r.iter_bytes():
            for ev in splitter.feed(chunk):
                if event_kind(ev) == "response.completed":  # the client may chain at once
                    assert run(env.store.get("resp_s1")) is not None
                events.append(ev)
    assert [event_kind(e) for e in events][-1] == "response.completed"
    doc = env.get("/v1/responses/resp_s1", env.all_key).json()
    assert doc["status"] == "completed" and doc["output"][0]["content"][0]["text"] == "w0 w1 w2"


def test_delete(env: StoredEnv) -> None:
    env.answer([head(200, json.dumps(response("resp_d1")).encode())])
    env.create()
    r = env.client.delete("/v1/responses/resp_d1", headers={"Authorization": f"Bearer {env.all_key}"})
    assert r.json() == {"id": "resp_d1", "object": "response", "deleted": True}
    _error(env.get("/v1/responses/resp_d1", env.all_key), 404, "not_found")


@pytest.mark.parametrize("path", ["/v1/responses/resp_zz", "/v1/responses/..%2Fkeys",
                                  "/v1/responses/resp_zz/input_items"])
def test_unknown_ids_are_404(env: StoredEnv, path: str) -> None:
    _error(env.get(path, env.all_key), 404, "not_found")


def test_background_runs_on_and_replays_from_starting_after(env: StoredEnv) -> None:
    env.answer(stream_items("resp_b1", deltas=4))
    r = env.create(background=True)
    assert r["id"] == "resp_b1" and r["background"] is True and r["status"] == "in_progress"
    doc = _wait_status(env, "resp_b1", "completed")
    assert doc["output"][0]["content"][0]["text"] == "w0 w1 w2"
    whole = _replay(env, "/v1/responses/resp_b1?stream=true")
    seqs = [event_data(e)["sequence_number"] for e in whole]
    assert seqs == list(range(6))
    rest = _replay(env, "/v1/responses/resp_b1?stream=true&starting_after=2")
    assert [event_data(e)["sequence_number"] for e in rest] == [3, 4, 5]  # none lost or repeated
    err = _error(env.get("/v1/responses/resp_b1?stream=true&starting_after=6", env.all_key),
                 400, "invalid_request")
    assert err["param"] == "starting_after"
    for bad in ("-1", "x"):
        _error(env.get(f"/v1/responses/resp_b1?stream=true&starting_after={bad}", env.all_key),
               400, "invalid_request")


def test_background_needs_store(env: StoredEnv) -> None:
    err = _error(env.post("/v1/responses", {"model": "tiny-chat", "input": "x", "store": False,
                                            "background": True}, key=env.all_key),
                 400, "invalid_request")
    assert err["param"] == "background" and env.models.calls == []


def test_only_a_background_response_streams_again(env: StoredEnv) -> None:
    env.answer([head(200, json.dumps(response("resp_f1")).encode())])
    env.create()
    err = _error(env.get("/v1/responses/resp_f1?stream=true", env.all_key), 400, "invalid_request")
    assert err["param"] == "stream"


def test_cancel_stops_the_engine(env: StoredEnv) -> None:
    stream = FakeStream(stream_items("resp_c1", hang=True))
    env.deps.pipeline.forwarder._clients["tiny-chat"] = FakeClient(stream, "tiny-chat")
    env.create(background=True)
    assert not stream.cancelled
    r = env.post("/v1/responses/resp_c1/cancel", key=env.all_key)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert _wait_status(env, "resp_c1", "cancelled")["status"] == "cancelled"
    assert len(run(env.store.events("resp_c1", -1))) == 4  # what came before the cancel is kept
    assert stream.cancelled  # the engine's work stopped


def test_a_revoked_key_stops_its_background_response(env: StoredEnv) -> None:
    env.answer(stream_items("resp_k1", hang=True))
    env.create(background=True, key=env.mate_key)
    revoke_key(env.keys_file, "mate")
    run(env.keys.refresh(force=True))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the key's owner cannot read it any more: the store can
        doc = json.loads(run(env.store.get("resp_k1")) or b"{}")["response"]
        if doc["status"] != "in_progress":
            break
        time.sleep(0.02)
    assert doc["status"] == "failed" and doc["error"]["code"] == "key_revoked"


def test_a_dead_replicas_run_is_failed_when_read(env: StoredEnv) -> None:
    env.answer(stream_items("resp_x1", hang=True))
    env.create(background=True)
    # As if another replica ran it and died: this replica does not run it, and its heartbeat ages.
    run_ = env.deps.responses._running.pop("resp_x1")
    raw = json.loads(run(env.store.get("resp_x1")))
    raw["heartbeat_at"] = time.time() - 60
    run(env.store.put("resp_x1", json.dumps(raw).encode(), 60))
    doc = env.get("/v1/responses/resp_x1", env.all_key).json()
    assert doc["status"] == "failed" and doc["error"]["code"] == "interrupted"
    run_.task.cancel()


def _wait_status(env: StoredEnv, rid: str, status: str, key: str | None = None,
                 timeout_s: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        doc = env.get(f"/v1/responses/{rid}", key or env.all_key).json()
        if doc.get("status") == status or time.monotonic() > deadline:
            assert doc.get("status") == status, doc
            return doc  # type: ignore[no-any-return]
        time.sleep(0.02)


def _replay(env: StoredEnv, path: str) -> list[bytes]:
    splitter = EventSplitter()
    with env.client.stream("GET", path, headers={"Authorization": f"Bearer {env.all_key}"}) as r:
        assert r.status_code == 200
        return [ev for chunk in r.iter_bytes() for ev in splitter.feed(chunk)]


def test_a_websocket_upgrade_is_refused_at_once(env: StoredEnv) -> None:
    """Codex with supports_websockets = true tries a WebSocket first and falls back to HTTP when
    the upgrade is refused: the gateway refuses it at the handshake, before any work."""
    from starlette.websockets import WebSocketDisconnect

    with pytest.raises(WebSocketDisconnect), env.client.websocket_connect(
            "/v1/responses", headers={"Authorization": f"Bearer {env.all_key}"}):
        pass
    assert env.models.calls == []


@pytest.mark.parametrize(("status", "ok"), [("incomplete", True), ("in_progress", False),
                                            ("failed", False)])
def test_what_can_be_continued(env: StoredEnv, status: str, ok: bool) -> None:
    env.answer([head(200, json.dumps(response("resp_p1", status=status)).encode())])
    env.create()
    env.answer([head(200, json.dumps(response("resp_p2")).encode())])
    r = env.post("/v1/responses", {"model": "tiny-chat", "input": "more",
                                   "previous_response_id": "resp_p1"}, key=env.all_key)
    if ok:
        assert r.status_code == 200, r.text
    else:
        assert _error(r, 400, "invalid_request")["param"] == "previous_response_id"
