"""serve_app.gateway.routing.router: model ids and aliases, per-key visibility."""

from __future__ import annotations

from typing import Any

import pytest

from serve_app import errors
from serve_app.gateway.routing.router import Router
from tests.unit.builders import app_config, key_record, model_doc

CFG = app_config(
    model_doc(id="tiny-chat", aliases=["tiny"]),
    model_doc(id="minilm-embed", task="embed", aliases=["all-minilm-l6-v2"]),
    model_doc(id="org/big"),
)


@pytest.fixture
def router() -> Router:
    return Router(CFG)


@pytest.mark.parametrize(
    ("name", "model_id", "task"),
    [
        ("tiny-chat", "tiny-chat", "generate"),
        ("tiny", "tiny-chat", "generate"),
        ("minilm-embed", "minilm-embed", "embed"),
        ("all-minilm-l6-v2", "minilm-embed", "embed"),
        ("org/big", "org/big", "generate"),
    ],
)
def test_ids_and_aliases_resolve(router: Router, name: str, model_id: str, task: str) -> None:
    route = router.resolve(name, key_record())
    assert (route.name, route.model_id, route.task) == (name, model_id, task)


def test_unknown_model_is_404(router: Router) -> None:
    with pytest.raises(errors.ModelNotFound) as exc_info:
        router.resolve("gpt-4", key_record())
    err = exc_info.value
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert "`gpt-4`" in err.message


def test_restricted_key_gets_404_for_other_models(router: Router) -> None:
    key = key_record(models=("tiny-chat",))
    assert router.resolve("tiny-chat", key).model_id == "tiny-chat"
    assert router.resolve("tiny", key).model_id == "tiny-chat"  # aliases of an allowed model
    with pytest.raises(errors.ModelNotFound) as forbidden:
        router.resolve("minilm-embed", key)
    with pytest.raises(errors.ModelNotFound) as unknown:
        router.resolve("no-such-model", key)
    # Forbidden and unknown look the same, so a key cannot probe which models exist.
    assert forbidden.value.status == unknown.value.status == 404
    assert forbidden.value.message.replace("minilm-embed", "X") == unknown.value.message.replace(
        "no-such-model", "X"
    )


def test_visible_lists_only_allowed_models(router: Router) -> None:
    names = {r.name for r in router.visible(key_record(models=("tiny-chat",)))}
    assert names == {"tiny-chat", "tiny"}


def test_visible_with_wildcard_lists_every_name(router: Router) -> None:
    names = {r.name for r in router.visible(key_record())}
    assert names == {"tiny-chat", "tiny", "minilm-embed", "all-minilm-l6-v2", "org/big"}


def test_key_without_any_known_model_sees_nothing(router: Router) -> None:
    assert router.visible(key_record(models=("other",))) == []


@pytest.mark.parametrize("bad", [None, 3, ["tiny"], {"id": "tiny"}, ""])
def test_model_must_be_a_non_empty_string(router: Router, bad: Any) -> None:
    with pytest.raises(errors.InvalidRequest) as exc_info:
        router.resolve(bad, key_record())
    err = exc_info.value
    assert type(err) is errors.InvalidRequest
    assert (err.status, err.param) == (400, "model")


def test_long_model_name_is_truncated_in_message(router: Router) -> None:
    with pytest.raises(errors.ModelNotFound) as exc_info:
        router.resolve("x" * 5000, key_record())
    assert len(exc_info.value.message) < 300
