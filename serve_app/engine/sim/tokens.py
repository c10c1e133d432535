"""Token ids for the simulated engine, made from the text without a tokenizer.

The ids only have to be stable: the same text prefix must give the same ids, so that a repeated
prompt hashes to the same KV blocks and hits the prefix cache as it would in vLLM. Each 4-character
chunk of the text is one token (about the ratio of real tokenizers on English, and the synthetic
upstream's estimate), its id a CRC of the chunk. A chat is rendered as a simple template (role
markers and contents, in order), so a conversation that grows by a turn keeps its prefix.
"""

from __future__ import annotations

import zlib
from typing import Any

CHARS_PER_TOKEN = 4
VOCAB = 128_000  # ids stay in a plausible vocabulary range


def text_ids(text: str) -> list[int]:
    """One id per ``CHARS_PER_TOKEN`` characters of ``text`` (at least one for any text)."""
    data = text.encode()
    ids = [zlib.crc32(data[i:i + CHARS_PER_TOKEN]) % VOCAB
           for i in range(0, len(data), CHARS_PER_TOKEN)]
    return ids or [0]


def chat_text(messages: Any) -> str:
    """The chat rendered as a plain template: a role marker and the content of each message."""
    parts = []
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            continue
        content = m.get("content", "")
        if isinstance(content, list):  # content parts: keep their text
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role', 'user')}|>{content}")
    return "".join(parts) + "<|assistant|>"


def prompt_ids(body: dict[str, Any]) -> list[int]:
    """The prompt's token ids: the chat's messages, or a completion's prompt (text, a list of
    texts, or token ids as vLLM accepts them)."""
    if "messages" in body:
        return text_ids(chat_text(body.get("messages")))
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
        return [int(t) for t in prompt]
    if isinstance(prompt, list):
        prompt = "".join(str(p) for p in prompt)
    return text_ids(str(prompt))
