"""Stored responses belong to their tenant: another tenant's id is unknown (404) on every route,
cannot be continued by previous_response_id, and is never cancelled or deleted by it; every route
checks the key before it reads anything."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from serve_app.protocol import head
from tests.keys import run
from tests.unit.test_api import _error
from tests.unit.test_stored_responses import StoredEnv, response, stream_items


@pytest.fixture
def env(tmp_path: Path) -> Iterator[StoredEnv]:
    e = StoredEnv(tmp_path)
    with e.client:
        yield e


def _routes(rid: str) -> list[tuple[str, str]]:
    return [("GET", f"/v1/responses/{rid}"), ("GET", f"/v1/responses/{rid}/input_items"),
            ("GET", f"/v1/responses/{rid}?stream=true"), ("DELETE", f"/v1/responses/{rid}"),
            ("POST", f"/v1/responses/{rid}/cancel")]


def test_another_tenants_response_is_unknown_everywhere(env: StoredEnv) -> None:
    env.answer(stream_items("resp_mine", hang=True))
    env.create(background=True)
    for method, path in _routes("resp_mine"):
        r = env.client.request(method, path, headers={"Authorization": f"Bearer {env.other_key}"})
        _error(r, 404, "not_found")
    calls = len(env.models.calls)
    err = _error(env.post("/v1/responses", {"model": "tiny-chat", "input": "x",
                                            "previous_response_id": "resp_mine"},
                          key=env.other_key), 400, "invalid_request")
    assert "resp_mine" in err["message"] and len(env.models.calls) == calls
    doc = json.loads(run(env.store.get("resp_mine")) or b"{}")
    assert doc["response"]["status"] == "in_progress"  # neither cancelled nor deleted
    assert not run(env.store.cancel_requested("resp_mine"))


def test_a_key_of_no_tenant_is_its_own_tenant(env: StoredEnv) -> None:
    env.answer([head(200, json.dumps(response("resp_solo")).encode())])
    env.create()
    _error(env.get("/v1/responses/resp_solo", env.mate_key), 404, "not_found")
    assert env.get("/v1/responses/resp_solo", env.all_key).status_code == 200


@pytest.mark.parametrize("key", [None, "sk-sa-not-a-key"])
def test_every_route_needs_a_key(env: StoredEnv, key: str | None) -> None:
    env.answer([head(200, json.dumps(response("resp_k")).encode())])
    env.create()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for method, path in _routes("resp_k"):
        _error(env.client.request(method, path, headers=headers), 401, "invalid_api_key")
    assert run(env.store.get("resp_k")) is not None
