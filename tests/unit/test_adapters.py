"""LoRA adapters as models (issue 41), without Ray or an engine: their config and its errors, the
builtin adapter's build, how the replica resolves a source, what vLLM's request gets as ``model``,
the gateway's routing and key access, and the /v1/models cards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from serve_app import errors
from serve_app.config import AppConfig, format_validation_error
from serve_app.engine import tiny_lora, tiny_model
from serve_app.engine.adapter import RequestAdapter
from serve_app.engine.sources import ModelSourceError, resolve_adapter, resolve_adapters
from serve_app.gateway.admission.tiers import TierPolicy
from serve_app.gateway.http.models import ModelCards
from serve_app.gateway.routing.router import Router
from serve_app.protocol import ENDPOINTS
from tests.unit.builders import app_config, app_doc, key_record, model, model_doc, shipped_config

LORA_ENGINE = {"enable_lora": True, "max_lora_rank": 8}
PIRATE = {"name": "tiny-chat-pirate", "source": "builtin:tiny-chat-pirate"}


def chat(**over: Any) -> dict[str, Any]:
    """tiny-chat with the builtin adapter (and ``over``), as a ``models[]`` document."""
    return model_doc("tiny-chat", **{"aliases": ["tiny"], "adapters": [PIRATE], "engine": LORA_ENGINE,
                                     **over})


def app_errors(*models: dict[str, Any], **over: Any) -> str:
    with pytest.raises(ValidationError) as exc_info:
        AppConfig.model_validate(app_doc(*models, **over))
    return format_validation_error(exc_info.value)


# ---- config --------------------------------------------------------------------------------------
def test_shipped_local_config_serves_the_builtin_adapter_on_tiny_chat() -> None:
    tiny = shipped_config("local").model("tiny-chat")
    assert [(a.name, a.source) for a in tiny.adapters] == [(PIRATE["name"], PIRATE["source"])]
    kw = tiny.engine_kwargs("/m")
    assert kw["enable_lora"] is True and kw["max_lora_rank"] == tiny_lora.RANK


def test_lora_engine_args_reach_vllm_under_its_names() -> None:
    kw = model(engine={"enable_lora": True, "max_loras": 2, "max_lora_rank": 32,
                       "max_cpu_loras": 4}).engine_kwargs("/m")
    assert (kw["enable_lora"], kw["max_loras"], kw["max_lora_rank"], kw["max_cpu_loras"]) == (
        True, 2, 32, 4)
    assert "max_loras" not in model().engine_kwargs("/m")  # unset: vLLM's own default


@pytest.mark.parametrize(("doc", "message"), [
    (chat(adapters=[PIRATE, PIRATE]),
     "adapter name ('tiny-chat-pirate') is given twice in model 'tiny-chat'"),
    (chat(adapters=[{"name": "tiny", "source": "builtin:tiny-chat-pirate"}]),
     "adapter name ('tiny') is already a name of model 'tiny-chat'"),
    (chat(engine={}), "adapters (['tiny-chat-pirate']) need engine.enable_lora true"),
    (chat(task="embed"), "adapters (['tiny-chat-pirate']) need a generate model, not 'embed'"),
    (chat(frontend={"lora_modules": []}), "frontend.lora_modules and adapters are exclusive"),
    (chat(adapters=[{"name": "x", "source": "builtin:nope"}]),
     "source ('builtin:nope') is not a builtin adapter"),
    (chat(adapters=[{"name": "bad name", "source": "/a"}]), "adapters.0.name"),
    (model_doc("other", source="/models/llama", adapters=[PIRATE], engine=LORA_ENGINE),
     "adapter source ('builtin:tiny-chat-pirate') is made for source 'builtin:tiny-chat'"),
    (model_doc(engine={"max_loras": 2}), "max_loras (2) needs enable_lora true"),
    (model_doc(engine={"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}),
     "max_cpu_loras (2) must be >= max_loras (4)"),
    (model_doc(engine={"enable_lora": True, "max_lora_rank": 12}), "max_lora_rank"),
])
def test_bad_adapter_config_names_the_field_and_value(doc: dict[str, Any], message: str) -> None:
    assert message in app_errors(doc)


@pytest.mark.parametrize(("models", "routes", "message"), [
    ([chat(), model_doc("tiny-chat-pirate")],
     None, "adapter name ('tiny-chat-pirate') of model 'tiny-chat' is already used by model "
     "'tiny-chat-pirate'"),
    ([chat(), model_doc("m2", adapters=[{"name": "tiny", "source": "/a"}], engine=LORA_ENGINE)],
     None, "adapter name ('tiny') of model 'm2' is already used by model 'tiny-chat'"),
    ([chat(), model_doc("m2", adapters=[PIRATE], engine=LORA_ENGINE)],
     None, "adapter name ('tiny-chat-pirate') of model 'm2' is already used by model 'tiny-chat'"),
    ([chat()], [{"name": "tiny-chat-pirate", "split": [{"model": "tiny-chat", "weight": 1}]}],
     "route name ('tiny-chat-pirate') is already used by model 'tiny-chat'"),
    ([chat()], [{"name": "ab", "split": [{"model": "tiny-chat-pirate", "weight": 1}]}],
     "split model ('tiny-chat-pirate') is not a model id"),
])
def test_adapter_names_never_collide_with_models_aliases_or_routes(
        models: list[dict[str, Any]], routes: list[dict[str, Any]] | None, message: str) -> None:
    assert message in app_errors(*models, **({"routes": routes} if routes else {}))


# ---- the builtin adapter and the replica's sources -----------------------------------------------
def test_builtin_adapter_is_a_deterministic_peft_folder(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    a = tiny_lora.build_tiny_lora(tmp_path / "a")
    b = tiny_lora.build_tiny_lora(tmp_path / "b")
    config = json.loads((a / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == tiny_lora.RANK
    wa, wb = load_file(str(a / "adapter_model.safetensors")), load_file(str(b / "adapter_model.safetensors"))
    assert sorted(wa) == sorted(wb) and len(wa) == 2 * len(tiny_lora.TARGETS) * tiny_model.LAYERS
    assert all(bool((wa[k] == wb[k]).all()) for k in wa)  # same seed, same bytes of weights
    down_b = "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
    assert tuple(wa[down_b].shape) == (tiny_model.HIDDEN, tiny_lora.RANK)
    assert tiny_lora.is_built(a) and tiny_lora.build_tiny_lora(a) == a  # cached, not rebuilt


def test_a_seed_makes_another_adapter_of_the_same_recipe(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    a = tiny_lora.build_tiny_lora(tmp_path / "a", seed=tiny_lora.SEED + 1)
    b = tiny_lora.build_tiny_lora(tmp_path / "b", seed=tiny_lora.SEED + 2)
    wa, wb = load_file(str(a / "adapter_model.safetensors")), load_file(str(b / "adapter_model.safetensors"))
    assert sorted(wa) == sorted(wb) and not all(bool((wa[k] == wb[k]).all()) for k in wa)
    assert tiny_lora.is_built(a, tiny_lora.SEED + 1) and not tiny_lora.is_built(a)  # not the builtin
    mtime = (a / "adapter_model.safetensors").stat().st_mtime_ns
    assert tiny_lora.build_tiny_lora(a, seed=tiny_lora.SEED + 1) == a  # cached, not rebuilt
    assert (a / "adapter_model.safetensors").stat().st_mtime_ns == mtime


def _peft_folder(path: Path, rank: int) -> Path:
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
    return path


def test_replica_resolves_builtin_and_folder_adapters(tmp_path: Path) -> None:
    folder = _peft_folder(tmp_path / "mine", 8)
    cfg = model("tiny-chat", engine=LORA_ENGINE, adapters=[
        PIRATE, {"name": "mine", "source": str(folder)}])
    paths = resolve_adapters(cfg, str(tmp_path / "cache"))
    assert paths == {"tiny-chat-pirate": str(tmp_path / "cache" / "adapters" / "tiny-chat-pirate"),
                     "mine": str(folder)}
    assert tiny_lora.is_built(Path(paths["tiny-chat-pirate"]))


def test_a_missing_folder_or_a_rank_above_the_engines_maximum_is_refused(tmp_path: Path) -> None:
    cfg = model("tiny-chat", engine=LORA_ENGINE,
                adapters=[{"name": "gone", "source": str(tmp_path / "gone")}])
    with pytest.raises(ModelSourceError, match="adapter 'gone': source .* is not a folder"):
        resolve_adapters(cfg, str(tmp_path))
    folder = _peft_folder(tmp_path / "big", 64)
    cfg = model("tiny-chat", engine=LORA_ENGINE, adapters=[{"name": "big", "source": str(folder)}])
    with pytest.raises(ModelSourceError, match=r"rank \(64\) is above engine.max_lora_rank \(8\)"):
        resolve_adapter(cfg.adapters[0], str(tmp_path), cfg.engine.max_lora_rank)


@pytest.mark.parametrize(("asked", "sent"), [
    ("tiny-chat-pirate", "tiny-chat-pirate"),  # vLLM's serving layer applies the adapter by name
    ("tiny", "tiny-chat"),  # an alias: vLLM knows only the id
    ("tiny-ab", "tiny-chat"),  # a split route's name
])
def test_vllm_request_keeps_an_adapters_name_and_resolves_the_rest(asked: str, sent: str) -> None:
    request, _ = RequestAdapter(model(**{k: v for k, v in chat().items() if k != "id"},
                                      id="tiny-chat")).prepare(
        ENDPOINTS["chat"], {"model": asked, "messages": [{"role": "user", "content": "hi"}]})
    assert request.model == sent


def test_a_run_time_adapters_name_reaches_vllm_only_when_the_replica_loaded_it() -> None:
    adapter = RequestAdapter(model(**{k: v for k, v in chat().items() if k != "id"}, id="tiny-chat"))
    body = {"model": "pirate-rt", "messages": [{"role": "user", "content": "hi"}]}
    assert adapter.prepare(ENDPOINTS["chat"], body, runtime_adapter="pirate-rt")[0].model == "pirate-rt"
    assert adapter.prepare(ENDPOINTS["chat"], body)[0].model == "tiny-chat"
    assert adapter.prepare(ENDPOINTS["chat"], body, runtime_adapter="other")[0].model == "tiny-chat"


# ---- routing, access and cards -------------------------------------------------------------------
def _cfg() -> AppConfig:
    return app_config(chat(fallback="spare"), model_doc("spare"))


def test_an_adapter_routes_to_its_base_models_deployment_without_fallback() -> None:
    router = Router(_cfg())
    route = router.resolve("tiny-chat-pirate", key_record())
    assert (route.name, route.pick(), route.task) == ("tiny-chat-pirate", "tiny-chat", "generate")
    assert router.fallback(route, "tiny-chat") is None  # another model has no such adapter
    assert router.fallback(router.resolve("tiny-chat", key_record()), "tiny-chat") == "spare"


@pytest.mark.parametrize(("models", "sees_adapter"), [
    (["*"], True),
    (["tiny-chat-pirate"], True),
    (["tiny-chat"], False),  # the base model's key does not reach its fine-tunes
    (["spare"], False),
])
def test_a_keys_models_may_name_adapters_and_others_get_the_unknown_models_404(
        models: list[str], sees_adapter: bool) -> None:
    router = Router(_cfg())
    key = key_record(models=models)
    names = [r.name for r in router.visible(key)]
    assert ("tiny-chat-pirate" in names) is sees_adapter
    if sees_adapter:
        assert router.resolve("tiny-chat-pirate", key).model_id == "tiny-chat"
        return
    with pytest.raises(errors.ModelNotFound) as hidden:
        router.resolve("tiny-chat-pirate", key)
    with pytest.raises(errors.ModelNotFound) as unknown:
        router.resolve("tiny-chat-parrot", key)
    # The same answer as for a name that does not exist, but for the name itself.
    assert hidden.value.message.replace("pirate", "parrot") == unknown.value.message
    assert (hidden.value.status, hidden.value.param) == (unknown.value.status, unknown.value.param)


def test_cards_list_adapters_as_vllm_does_without_a_server_path(tmp_path: Path) -> None:
    folder = tmp_path / "secret-place" / "mine"
    cfg = app_config(chat(adapters=[PIRATE, {"name": "mine", "source": str(folder)}]))
    key = key_record()
    cards = ModelCards(cfg, TierPolicy(cfg), 0)
    by_id = {c["id"]: c for c in cards.listing(Router(cfg).visible(key), key, None)["data"]}
    assert set(by_id) == {"tiny-chat", "tiny", "tiny-chat-pirate", "mine"}
    pirate, mine, alias = by_id["tiny-chat-pirate"], by_id["mine"], by_id["tiny"]
    assert (pirate["parent"], pirate["root"]) == ("tiny-chat", "builtin:tiny-chat-pirate")
    assert (mine["parent"], mine["root"]) == ("tiny-chat", "mine")
    assert (alias["parent"], alias["root"]) == ("tiny-chat", "tiny-chat")
    assert by_id["tiny-chat"]["parent"] is None
    for card in (pirate, mine):
        assert card["root"] != card["parent"]  # how a client tells an adapter from an alias
    assert str(tmp_path) not in json.dumps(by_id)
    assert pirate["max_model_len"] == by_id["tiny-chat"]["max_model_len"]
