"""serve_app.engine.tiny_model: a deterministic, cached build (at most two real builds here)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from serve_app.engine.tiny_model import (
    MARKER,
    RECIPE_VERSION,
    build_tiny_model,
    is_built,
    template_digest,
)

ARTIFACTS = ("model.safetensors", "tokenizer.json")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The first build, and a snapshot of its bytes taken before any other test touches it."""
    path = tmp_path_factory.mktemp("tiny") / "models" / "tiny-chat"
    assert not is_built(path)
    out = build_tiny_model(path)
    return {"path": out, "bytes": {name: (out / name).read_bytes() for name in ARTIFACTS}}


def test_build_returns_the_resolved_path(built: dict[str, Any]) -> None:
    path: Path = built["path"]
    assert path.is_absolute() and path.name == "tiny-chat"
    assert is_built(path)


def test_build_writes_a_loadable_model_folder(built: dict[str, Any]) -> None:
    path: Path = built["path"]
    for name in (*ARTIFACTS, "config.json", "tokenizer_config.json", MARKER):
        assert (path / name).is_file(), name
    assert not list(path.parent.glob(".tiny-build-*"))  # no half-written temp dirs left behind


def test_config_head_dim_is_64(built: dict[str, Any]) -> None:
    cfg = json.loads((built["path"] / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64
    assert cfg.get("head_dim", 64) == 64


def test_tokenizer_has_chat_template_and_special_tokens(built: dict[str, Any]) -> None:
    path: Path = built["path"]
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    template = tok_cfg.get("chat_template") or (path / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    assert {"<|im_start|>", "<|im_end|>", "<s>", "</s>"} <= set(vocab)


def test_second_call_without_force_does_not_rebuild(built: dict[str, Any]) -> None:
    path: Path = built["path"]
    before = {name: (path / name).stat().st_mtime_ns for name in (*ARTIFACTS, MARKER)}
    assert build_tiny_model(path) == path
    after = {name: (path / name).stat().st_mtime_ns for name in (*ARTIFACTS, MARKER)}
    assert after == before


def test_forced_rebuild_is_byte_identical(built: dict[str, Any]) -> None:
    path: Path = built["path"]
    build_tiny_model(path, force=True)
    for name in ARTIFACTS:
        assert (path / name).read_bytes() == built["bytes"][name], name
    assert is_built(path)


def test_stale_recipe_is_not_built(tmp_path: Path) -> None:
    (tmp_path / MARKER).write_text(json.dumps({"recipe": "0"}))
    assert not is_built(tmp_path)
    # A build made with another chat template (an older checkout) is rebuilt, not reused.
    (tmp_path / MARKER).write_text(json.dumps({"recipe": RECIPE_VERSION, "template": "0" * 16}))
    assert not is_built(tmp_path)
    (tmp_path / MARKER).write_text(json.dumps({"recipe": RECIPE_VERSION}))
    assert not is_built(tmp_path)
    (tmp_path / MARKER).write_text(json.dumps({"recipe": RECIPE_VERSION, "template": template_digest()}))
    assert is_built(tmp_path)
    (tmp_path / MARKER).write_text("[1]")
    assert not is_built(tmp_path)
    (tmp_path / MARKER).write_text("{not json")
    assert not is_built(tmp_path)
    assert not is_built(tmp_path / "missing")


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]


def _tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_template_renders_tools_in_the_system_turn(built: dict[str, Any]) -> None:
    tok = _tokenizer(built["path"])
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}],
        tools=TOOLS, tokenize=False, add_generation_prompt=True,
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert text.count("<|im_start|>system") == 1  # the system message is merged, not repeated
    assert text.endswith("<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n")


def test_template_without_tools_is_plain_chatml(built: dict[str, Any]) -> None:
    tok = _tokenizer(built["path"])
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_template_round_trips_a_tool_call_through_the_hermes_parser(built: dict[str, Any]) -> None:
    """What the template writes for an assistant's call is what vLLM's hermes parser reads back,
    and tool results (several in a row) land in one user turn."""
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    tok = _tokenizer(built["path"])
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "warm"},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assistant = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = Hermes2ProToolParser(tok).extract_tool_calls(assistant, request=None)  # type: ignore[arg-type]
    assert parsed.tools_called
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert text.endswith("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
                         "<tool_response>\nwarm\n</tool_response><|im_end|>\n")
