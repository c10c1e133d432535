"""The APIs coding agents speak, through the gateway, driven by the official SDKs: OpenAI's
Responses API (Codex) and Anthropic's Messages API (Claude Code), plus what `vllm serve` also has
(/tokenize, /detokenize, /v1/score, /v1/rerank) and the probes Claude Code makes (HEAD /,
/v1/models?limit=)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

TOOL = {"type": "function", "name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}


@pytest.fixture(scope="module")
def oai(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=stack.keys["all"], max_retries=0)


@pytest.fixture(scope="module")
def claude(stack) -> anthropic.Anthropic:
    # x-api-key, as Claude Code sends ANTHROPIC_API_KEY; the base URL has no /v1.
    return anthropic.Anthropic(base_url=stack.root_url, api_key=stack.keys["all"], max_retries=0)


# ---- Responses API ------------------------------------------------------------------------------
def test_responses_create(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model="tiny-chat", input="Say hi.", max_output_tokens=16, store=False)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.model == "tiny-chat"
    message = next(o for o in r.output if o.type == "message")
    assert message.content[0].type == "output_text" and isinstance(r.output_text, str)
    assert r.usage is not None and r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 16


def test_responses_stream_with_tools(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(
        model="tiny-chat", input="Open README.md", tools=[TOOL], tool_choice="auto",
        max_output_tokens=16, stream=True, store=False,
    ))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response
    assert final.usage is not None and final.usage.output_tokens > 0


def test_responses_codex_shaped_multi_turn(oai: openai.OpenAI) -> None:
    """What Codex sends on its second turn: developer instructions, the user's message, the
    model's function call and the tool's output, as input items; stored nothing."""
    items = [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "You are a coding agent."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files"}]},
        {"type": "function_call", "call_id": "call_1", "name": "exec_command",
         "arguments": json.dumps({"cmd": "ls"})},
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nMakefile"},
    ]
    tool = {**TOOL, "name": "exec_command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}
    r = oai.responses.create(model="tiny-chat", input=items, tools=[tool], store=False,
                             max_output_tokens=16, parallel_tool_calls=True)
    assert r.status in ("completed", "incomplete") and r.output
    assert r.usage.input_tokens > 40  # the whole history was rendered into the prompt


# ---- Messages API --------------------------------------------------------------------------------
def test_messages_create_with_x_api_key(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(model="tiny-chat", max_tokens=16,
                               messages=[{"role": "user", "content": "Say hi."}])
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny-chat"
    assert m.content and m.content[0].type == "text"
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 16
    assert m.stop_reason in ("end_turn", "max_tokens")


def test_messages_stream_with_bearer_and_tools(stack) -> None:
    """ANTHROPIC_AUTH_TOKEN is sent as Bearer; Claude Code always streams, with tools."""
    client = anthropic.Anthropic(base_url=stack.root_url, auth_token=stack.keys["all"],
                                 max_retries=0)
    tools = [{"name": "Read", "description": "Read a file",
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
    with client.messages.stream(model="tiny-chat", max_tokens=16, tools=tools, system="Be brief.",
                                messages=[{"role": "user", "content": "Open README.md"}]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and "message_stop" in kinds
    assert final.usage.output_tokens > 0


def test_messages_beta_query_and_headers(stack) -> None:
    """Claude Code's exact request line: ?beta=true and its anthropic-* headers."""
    r = httpx.post(f"{stack.root_url}/v1/messages?beta=true", timeout=60, headers={
        "x-api-key": stack.keys["all"], "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
    }, json={"model": "tiny-chat", "max_tokens": 8, "stream": True,
             "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.startswith("event: message_start") and "event: message_stop" in r.text


def test_count_tokens(claude: anthropic.Anthropic) -> None:
    short = claude.messages.count_tokens(model="tiny-chat",
                                         messages=[{"role": "user", "content": "hi"}])
    longer = claude.messages.count_tokens(model="tiny-chat",
                                          messages=[{"role": "user", "content": "hi " * 50}])
    assert 0 < short.input_tokens < longer.input_tokens


def test_messages_errors_use_anthropics_envelope(stack, claude: anthropic.Anthropic) -> None:
    bad = anthropic.Anthropic(base_url=stack.root_url, api_key="sk-sa-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        bad.messages.create(model="tiny-chat", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert auth.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": "Incorrect API key provided."}}
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="no-such-model", max_tokens=4,
                               messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    from tests.integration.conftest import MAX_MODEL_LEN

    with pytest.raises(anthropic.BadRequestError) as too_long:
        claude.messages.create(model="tiny-chat", max_tokens=4,
                               messages=[{"role": "user", "content": "\u4e2d" * (MAX_MODEL_LEN // 2)}])
    assert too_long.value.body["type"] == "error"
    assert too_long.value.body["error"]["type"] == "invalid_request_error"
    assert too_long.value.body["error"]["message"].startswith("prompt is too long")


def test_openai_routes_keep_openais_envelope(stack) -> None:
    r = httpx.post(f"{stack.base_url}/chat/completions", headers={"x-api-key": "sk-sa-wrong"},
                   json={"model": "tiny-chat", "messages": []}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


# ---- probes, tokenizer, scoring ------------------------------------------------------------------
def test_root_answers_get_and_head(stack) -> None:
    assert httpx.get(stack.root_url + "/", timeout=10).status_code == 200
    assert httpx.head(stack.root_url + "/", timeout=10).status_code == 200


def test_models_limit(stack) -> None:
    headers = {"x-api-key": stack.keys["all"]}
    every = httpx.get(f"{stack.base_url}/models?limit=1000", headers=headers, timeout=10).json()
    one = httpx.get(f"{stack.base_url}/models?limit=1", headers=headers, timeout=10).json()
    assert len(every["data"]) > 1 and one["data"] == every["data"][:1]
    bad = httpx.get(f"{stack.base_url}/models?limit=zero", headers=headers, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def test_tokenize_round_trip(stack) -> None:
    headers = {"Authorization": f"Bearer {stack.keys['all']}"}
    t = httpx.post(f"{stack.root_url}/tokenize", headers=headers, timeout=30,
                   json={"model": "tiny", "prompt": "hello world"}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] > 0
    chat = httpx.post(f"{stack.root_url}/tokenize", headers=headers, timeout=30,
                      json={"model": "tiny-chat", "messages": [{"role": "user", "content": "hello world"}]})
    assert chat.status_code == 200 and chat.json()["count"] > t["count"]  # the template's tokens
    d = httpx.post(f"{stack.root_url}/detokenize", headers=headers, timeout=30,
                   json={"model": "tiny-chat", "tokens": t["tokens"]})
    assert d.status_code == 200 and d.json()["prompt"] == "hello world"


def test_score_and_rerank(stack) -> None:
    headers = {"Authorization": f"Bearer {stack.keys['all']}"}
    s = httpx.post(f"{stack.base_url}/score", headers=headers, timeout=60, json={
        "model": "minilm-embed", "text_1": "a cat", "text_2": ["a kitten", "a tax form"]})
    assert s.status_code == 200, s.text
    scores = [d["score"] for d in s.json()["data"]]
    assert len(scores) == 2 and scores[0] > scores[1]
    r = httpx.post(f"{stack.base_url}/rerank", headers=headers, timeout=60, json={
        "model": "minilm-embed", "query": "a cat", "documents": ["a tax form", "a kitten"]})
    assert r.status_code == 200, r.text
    best = max(r.json()["results"], key=lambda x: x["relevance_score"])
    assert best["index"] == 1
    chat_model = httpx.post(f"{stack.base_url}/rerank", headers=headers, timeout=10, json={
        "model": "tiny-chat", "query": "q", "documents": ["d"]})
    assert chat_model.status_code == 400 and chat_model.json()["error"]["param"] == "model"
