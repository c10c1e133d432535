"""LoRA adapters added at run time (issue 41): the state layer's stores, the admin API, the
router's view of them and a model replica's loader (``engine.loras``).

The admin API runs on the real gateway app (FastAPI, keys, audit, router, forwarder) with fake
model clients; the loader runs against a stand-in for vLLM's ``OpenAIServingModels`` and the
engine (what it calls, and when). The real engine is tests/integration/test_lora.py's."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from serve_app import errors
from serve_app.config import ModelConfig
from serve_app.engine.loras import RuntimeLoras
from serve_app.gateway.keys.ops import KeyOps
from serve_app.gateway.routing.adapters import RuntimeAdapter, RuntimeAdapters
from serve_app.protocol import head, tokens_of
from serve_app.state.adapters import AdapterDocs, MemoryAdapterStore, RedisAdapterStore, SqliteAdapterStore
from serve_app.state.connections import SqliteFile
from tests.keys import run
from tests.unit.test_admin_api import Admin

TINY = {"id": "tiny-chat", "source": "builtin:tiny-chat", "aliases": ["tiny"],
        "engine": {"enable_lora": True, "max_lora_rank": 8}}
PLAIN = {"id": "plain", "source": "builtin:tiny-chat"}
NEW = {"name": "pirate-2", "model": "tiny-chat", "source": "builtin:tiny-chat-pirate"}
ERROR_FIELDS = {"message", "type", "param", "code"}


# ---- the stores ---------------------------------------------------------------------------------
async def _contract(store: AdapterDocs) -> None:
    assert await store.all() == {}
    assert await store.add("a", b'{"v":1}') is True
    assert await store.add("a", b'{"v":2}') is False  # a taken name stores nothing
    assert await store.add("b", b"{}") is True
    assert await store.all() == {"a": b'{"v":1}', "b": b"{}"}
    assert await store.delete("a") is True and await store.delete("a") is False
    assert await store.all() == {"b": b"{}"}


def test_memory_store() -> None:
    asyncio.run(_contract(MemoryAdapterStore()))


def test_sqlite_store_is_durable(tmp_path: Path) -> None:
    f = SqliteFile(tmp_path / "adapters.sqlite")
    asyncio.run(_contract(SqliteAdapterStore(f)))
    f.close()
    again = SqliteAdapterStore(SqliteFile(tmp_path / "adapters.sqlite"))  # a restarted gateway
    assert asyncio.run(again.all()) == {"b": b"{}"}


def test_redis_store(redis_url: str) -> None:
    async def go() -> None:
        client = aioredis.Redis.from_url(redis_url)
        try:
            await client.delete("test:adapters")
            await _contract(RedisAdapterStore(client, key="test:adapters"))
        finally:
            await client.aclose()

    asyncio.run(go())


def test_a_record_that_cannot_be_read_is_skipped() -> None:
    store = MemoryAdapterStore()
    good = RuntimeAdapter("ok", "tiny-chat", "/srv/a")
    asyncio.run(store.add("ok", good.to_json()))
    asyncio.run(store.add("bad", b"not json"))
    table = RuntimeAdapters(store)
    asyncio.run(table.refresh(force=True))
    assert [a.name for a in table.all()] == ["ok"] and table.get("ok") == good
    assert good.label == "ok" and RuntimeAdapter("x", "m", "builtin:tiny-chat-pirate").label == \
        "builtin:tiny-chat-pirate"  # a card's root never shows a folder


# ---- the admin API and the router ---------------------------------------------------------------
@pytest.fixture
def gw(tmp_path: Path) -> Any:
    a = Admin(tmp_path, models=[TINY, PLAIN])
    a.models.items = [head(200, b'{"object": "text_completion"}', tokens=tokens_of(1, 1))]
    with a.client:
        yield a


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_FIELDS
    if param is not None:
        assert err["param"] == param, err
    return err  # type: ignore[no-any-return]


def _key(gw: Admin, key_id: str, models: list[str], tenant: str | None = None) -> str:
    return run(KeyOps(gw.deps.keys).create(key_id, models=models, tenant=tenant)).secret


def _chat(gw: Admin, key: str, model: str) -> httpx.Response:
    return gw.call("POST", "/v1/chat/completions", key,
                   json={"model": model, "messages": [{"role": "user", "content": "hi"}]})


def test_an_added_adapter_is_tried_on_a_replica_then_served_with_its_source(gw: Admin) -> None:
    r = gw.call("POST", "/admin/v1/adapters", gw.admin, json=NEW)
    assert r.status_code == 201, r.text
    assert r.json() | {"created_at": 0} == {"object": "adapter", **NEW, "tenant": None, "created_at": 0,
                                            "created_by": "root"}
    probe = gw.models.calls[-1]  # one token from one replica, with the adapter's source
    assert (probe.model_id, probe.endpoint, probe.body["model"], probe.body["max_tokens"]) == \
        ("tiny-chat", "completions", "pirate-2", 1)
    assert probe.ctx["adapter"] == {"name": "pirate-2", "source": "builtin:tiny-chat-pirate", "check": "1"}

    key = _key(gw, "app", ["*"])
    assert _chat(gw, key, "pirate-2").status_code == 200
    call = gw.models.calls[-1]
    assert call.model_id == "tiny-chat" and call.body["model"] == "pirate-2"
    assert call.ctx["adapter"]["name"] == "pirate-2"
    assert _chat(gw, key, "tiny-chat").status_code == 200
    assert gw.models.calls[-1].ctx["adapter"] is None  # the base model's requests carry none
    cards = {c["id"]: c for c in gw.call("GET", "/v1/models", key).json()["data"]}
    assert (cards["pirate-2"]["parent"], cards["pirate-2"]["root"]) == ("tiny-chat", "builtin:tiny-chat-pirate")
    listed = gw.call("GET", "/admin/v1/adapters", gw.admin).json()["data"]
    assert [a["name"] for a in listed] == ["pirate-2"]
    assert '"action":"adapter.create","target":"pirate-2","result":"ok"' in gw.audit()


def test_a_deleted_adapter_is_the_404_of_an_unknown_model(gw: Admin) -> None:
    assert gw.call("POST", "/admin/v1/adapters", gw.admin, json=NEW).status_code == 201
    key = _key(gw, "app", ["*"])
    assert _chat(gw, key, "pirate-2").status_code == 200
    r = gw.call("DELETE", "/admin/v1/adapters/pirate-2", gw.admin)
    assert r.status_code == 200 and r.json()["deleted"] is True
    gone = _error(_chat(gw, key, "pirate-2"), 404, "model")
    never = _error(_chat(gw, key, "pirate-3"), 404, "model")
    assert gone["message"].replace("pirate-2", "X") == never["message"].replace("pirate-3", "X")
    assert "pirate-2" not in gw.call("GET", "/v1/models", key).text
    _error(gw.call("DELETE", "/admin/v1/adapters/pirate-2", gw.admin), 404)


def test_a_private_adapter_is_reached_by_its_tenants_keys_only(gw: Admin) -> None:
    body = {**NEW, "tenant": "acme"}
    assert gw.call("POST", "/admin/v1/adapters", gw.admin, json=body).status_code == 201
    own = _key(gw, "acme-app", ["*"], tenant="acme")
    other = _key(gw, "rival-app", ["*"], tenant="rival")
    named = _key(gw, "rival-named", ["pirate-2"], tenant="rival")
    assert _chat(gw, own, "pirate-2").status_code == 200
    for secret in (other, named):
        err = _error(_chat(gw, secret, "pirate-2"), 404, "model")
        assert err == _error(_chat(gw, secret, "pirate-x"), 404, "model") | {
            "message": err["message"]}
        assert "pirate-2" not in gw.call("GET", "/v1/models", secret).text


def test_a_key_must_name_the_adapter(gw: Admin) -> None:
    assert gw.call("POST", "/admin/v1/adapters", gw.admin, json=NEW).status_code == 201
    base_only = _key(gw, "base", ["tiny-chat"])
    _error(_chat(gw, base_only, "pirate-2"), 404, "model")
    assert _chat(gw, _key(gw, "named", ["pirate-2"]), "pirate-2").status_code == 200


@pytest.mark.parametrize("body, status, param", [
    ({**NEW, "name": "tiny-chat"}, 409, "name"),  # a model's id
    ({**NEW, "name": "tiny"}, 409, "name"),  # an alias
    ({**NEW, "model": "nope"}, 400, "model"),
    ({**NEW, "model": "plain"}, 400, "model"),  # no enable_lora
    ({**NEW, "name": "bad name!"}, 400, "name"),
    ({**NEW, "extra": 1}, 400, "extra"),
])
def test_bad_adapters_are_refused_before_any_replica_is_asked(gw: Admin, body: dict[str, Any], status: int,
                                                              param: str) -> None:
    _error(gw.call("POST", "/admin/v1/adapters", gw.admin, json=body), status, param)
    assert gw.models.calls == []
    assert gw.call("GET", "/admin/v1/adapters", gw.admin).json()["data"] == []


def test_an_adapter_the_replica_cannot_load_is_not_stored(gw: Admin) -> None:
    gw.models.items = [head(400, json.dumps({"error": {
        "message": "adapter 'p': rank (16) is above engine.max_lora_rank (8)", "type": "invalid_request_error",
        "param": "source", "code": None}}).encode())]
    err = _error(gw.call("POST", "/admin/v1/adapters", gw.admin,
                         json={**NEW, "source": "/srv/adapters/wide"}), 400, "source")
    assert "rank (16) is above engine.max_lora_rank (8)" in err["message"]
    assert gw.call("GET", "/admin/v1/adapters", gw.admin).json()["data"] == []
    assert '"action":"adapter.create","target":"pirate-2","result":"invalid_request"' in gw.audit()


def test_a_taken_adapter_name_is_a_conflict(gw: Admin) -> None:
    assert gw.call("POST", "/admin/v1/adapters", gw.admin, json=NEW).status_code == 201
    _error(gw.call("POST", "/admin/v1/adapters", gw.admin, json=NEW), 409, "name")


def test_only_an_admin_key_manages_adapters(gw: Admin) -> None:
    client = _key(gw, "app", ["*"])
    _error(gw.call("POST", "/admin/v1/adapters", client, json=NEW), 403)
    _error(gw.call("GET", "/admin/v1/adapters", client), 403)
    _error(gw.call("DELETE", "/admin/v1/adapters/x", client), 403)
    _error(gw.call("POST", "/admin/v1/adapters", None, json=NEW), 401)
    assert gw.models.calls == []


# ---- a model replica's loader -------------------------------------------------------------------
class FakeServingModels:
    """vLLM's OpenAIServingModels as the loader calls it."""

    def __init__(self, refuse: str | None = None) -> None:
        self.log: list[tuple[str, str]] = []
        self.lora_requests: dict[str, Any] = {}
        self.refuse = refuse
        self._next_id = 0

    async def load_lora_adapter(self, request: Any, base_model_name: str | None = None) -> Any:
        self.log.append(("load", request.lora_path))
        if self.refuse:
            class Err:
                error = type("E", (), {"code": 400, "message": self.refuse})()
            return Err()
        self._next_id += 1
        self.lora_requests[request.lora_name] = type("L", (), {"lora_int_id": self._next_id})()
        return "Success"

    async def unload_lora_adapter(self, request: Any) -> Any:
        self.log.append(("unload", request.lora_name))
        self.lora_requests.pop(request.lora_name, None)
        return "Success"


class FakeEngine:
    def __init__(self, models: FakeServingModels) -> None:
        self.models = models

    async def remove_lora(self, lora_id: int) -> bool:
        self.models.log.append(("remove", str(lora_id)))
        return True


def _peft(path: Path, rank: int) -> str:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    return str(path)


class Counted:
    """AdapterMetrics as the loader feeds it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int]] = []

    def load(self, *, adapter: str, result: str, loaded: int) -> None:
        self.seen.append((adapter, result, loaded))


def _loras(tmp_path: Path, refuse: str | None = None) -> tuple[RuntimeLoras, FakeServingModels]:
    cfg = ModelConfig.model_validate({**TINY, "adapters": [{"name": "tiny-chat-pirate",
                                                            "source": "builtin:tiny-chat-pirate"}]})
    models = FakeServingModels(refuse)
    loras = RuntimeLoras(cfg, str(tmp_path / "cache"), models, FakeEngine(models), Counted())  # type: ignore[arg-type]
    return loras, models


def test_the_loader_loads_once_per_source_and_swaps_only_once_idle(tmp_path: Path) -> None:
    loras, models = _loras(tmp_path)
    first, second = _peft(tmp_path / "v1", 8), _peft(tmp_path / "v2", 4)

    async def go() -> None:
        await loras.ensure("mine", first)
        await loras.ensure("mine", first)  # loaded: nothing to do
        assert models.log == [("load", first)]
        with loras.using("mine"):  # a request on the old one is running
            swap = asyncio.ensure_future(loras.ensure("mine", second))
            await asyncio.sleep(0.2)
            assert not swap.done() and models.log == [("load", first)]
        await swap
        assert models.log == [("load", first), ("unload", "mine"), ("remove", "1"), ("load", second)]
        assert loras.loaded == {"mine": second}
        assert loras.metrics.seen == [("mine", "loaded", 1), ("mine", "replaced", 0),  # type: ignore[union-attr]
                                      ("mine", "loaded", 1)]

    asyncio.run(go())


@pytest.mark.parametrize("source, message", [
    ("/no/such/folder", "is not a folder with an adapter_config.json"),
    ("WIDE", "rank (16) is above engine.max_lora_rank (8)"),
    ("builtin:nope", "is not a builtin adapter"),
])
def test_the_loader_refuses_what_cannot_load_and_loads_nothing(tmp_path: Path, source: str,
                                                               message: str) -> None:
    loras, models = _loras(tmp_path)
    if source == "WIDE":
        source = _peft(tmp_path / "wide", 16)
    with pytest.raises(errors.InvalidRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
        asyncio.run(loras.ensure("mine", source))
    assert models.log == [] and loras.loaded == {}
    assert loras.metrics.seen == ([] if "builtin" in source else [("mine", "refused", 0)])  # type: ignore[union-attr]


def test_the_loader_refuses_a_configured_name_and_passes_on_vllms_refusal(tmp_path: Path) -> None:
    loras, models = _loras(tmp_path)
    with pytest.raises(errors.InvalidRequest, match="already a name of model"):
        asyncio.run(loras.ensure("tiny-chat-pirate", _peft(tmp_path / "a", 8)))
    loras, models = _loras(tmp_path, refuse="bad weights")
    with pytest.raises(errors.InvalidRequest, match="could not be loaded: bad weights"):
        asyncio.run(loras.ensure("mine", _peft(tmp_path / "b", 8)))
    assert loras.loaded == {}


def test_a_client_is_never_told_a_folder_only_the_admin_check_is(tmp_path: Path) -> None:
    from serve_app.engine.server import EngineServer

    server = EngineServer(ModelConfig.model_validate(TINY), "/dummy/path")
    server.loras, _ = _loras(tmp_path)
    secret_path = str(tmp_path / "private" / "folder")
    told = asyncio.run(server._load_adapter({"name": "mine", "source": secret_path, "check": "1"}))
    assert isinstance(told, errors.InvalidRequest) and secret_path in str(told)
    client = asyncio.run(server._load_adapter({"name": "mine", "source": secret_path}))
    assert isinstance(client, errors.ServiceUnavailable) and "private" not in str(client)


def test_an_adapter_added_through_another_gateway_replica_answers_here_at_once(gw: Admin) -> None:
    """Added through replica A (its record in the shared store), asked for on replica B before B's
    periodic refresh: B reads the store on the miss rather than answering 404 for up to 2 s."""
    key = _key(gw, "k-miss", ["tiny-chat", "pirate-2", "pirate-nobody"])
    runtime = gw.deps.router.runtime
    assert runtime is not None
    run(runtime.refresh(force=True))  # B's table is fresh, and the adapter is not in it
    run(runtime.store.add("pirate-2", RuntimeAdapter("pirate-2", "tiny-chat",
                                                     "builtin:tiny-chat-pirate").to_json()))
    assert _chat(gw, key, "pirate-2").status_code == 200
    _error(_chat(gw, key, "pirate-nobody"), 404, "model")  # a name nobody added stays a 404


def test_a_burst_of_unknown_names_reads_the_store_once() -> None:
    async def go() -> None:
        store = MemoryAdapterStore()
        table = RuntimeAdapters(store)
        await table.refresh(force=True)
        reads: list[int] = []
        real_all = store.all

        async def counted() -> Any:
            reads.append(1)
            return await real_all()

        store.all = counted  # type: ignore[method-assign]
        await store.add("late", RuntimeAdapter("late", "tiny-chat", "/srv/late").to_json())
        await asyncio.gather(*(table.on_miss(f"name-{i % 3}") for i in range(20)), table.on_miss("late"))
        assert len(reads) == 1 and table.get("late") is not None
        await table.on_miss("late")  # known now: no read
        assert len(reads) == 1

    asyncio.run(go())
