"""Tool calling on the embedded default, as coding agents use it (Codex, Claude Code and Cline all
send ``tools`` with ``tool_choice: "auto"`` on their first request), and the prefix-cache hits that
clients such as Cline show (``usage.prompt_tokens_details.cached_tokens``).

tiny-chat's weights are random, so these tests check that tool requests are accepted and answered
in the right shape, not that the model decides to call a tool.
"""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.integration

TOOLS = [{
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the workspace",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]},
    },
}]


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=stack.keys["all"], max_retries=0)


def test_tools_with_auto_choice_are_answered(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "open README.md"}],
        tools=TOOLS, tool_choice="auto", max_tokens=16,
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    # Either text or well-formed calls of a declared tool: never a half-parsed mix.
    if choice.message.tool_calls:
        for call in choice.message.tool_calls:
            assert call.function.name == "read_file"
            json.loads(call.function.arguments)
    else:
        assert isinstance(choice.message.content, str)
    assert r.usage.prompt_tokens > 60  # the tool signatures are in the prompt


def test_tools_stream_and_a_tool_result_turn(client: openai.OpenAI) -> None:
    """The second turn of an agent loop: the assistant's call and the tool's result go back."""
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "open README.md"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": "README.md"})},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "# serve-app"},
    ]
    chunks = list(client.chat.completions.create(
        model="tiny-chat", messages=messages, tools=TOOLS, tool_choice="auto", max_tokens=16,
        stream=True, stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0] in ("stop", "length", "tool_calls")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_cached_tokens_are_reported(client: openai.OpenAI) -> None:
    """Two requests sharing a long prefix: the second reports prefix-cache hits."""
    prefix = "You are a careful assistant. " * 40
    usages = []
    for tail in ("first question", "second question"):
        r = client.chat.completions.create(
            model="tiny-chat", max_tokens=4,
            messages=[{"role": "system", "content": prefix}, {"role": "user", "content": tail}],
        )
        usages.append(r.usage)
    details = usages[1].prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= 128  # whole KV blocks of the shared prefix
    assert details.cached_tokens < usages[1].prompt_tokens
