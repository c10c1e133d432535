"""The engine clients that sit between vLLM's serving layer and the engine.

vLLM's OpenAI serving objects are built around an engine client (``init_app_state(engine_client,
...)``) and call its ``generate`` for every chat or text completion. This replica builds that client
as a chain, outermost first, and hands the chain to ``init_app_state``:

    PacedEngineClient (pacing.py)  -> reads each stream at most once per interval, counts tokens
    GatedEngineClient (slots.py)   -> holds a request until an engine slot it may take is free
    AsyncLLM (vLLM)                -> the engine

Each wrapper implements ``generate`` and hands every other attribute to the client it wraps.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol


class EngineClient(Protocol):
    """What the wrappers implement: vLLM's ``EngineClient.generate`` (the rest is delegated).

    ``generate`` yields vLLM ``RequestOutput`` objects for one request; closing the iterator early
    aborts the request in the engine.
    """

    def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
    ) -> AsyncIterator[Any]: ...


@dataclass
class TokenMeter:
    """Tokens the engine produced for one API request (all its choices), as it streams.

    The replica sets one in ``current_meter`` before it calls vLLM's serving layer; the paced client
    adds every engine output to it. Tasks that vLLM spawns copy the context, so they see it too.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, output: Any) -> None:
        """Count one ``RequestOutput`` of a streamed (``DELTA``) request."""
        prompt = getattr(output, "prompt_token_ids", None)
        if prompt and not self.prompt_tokens:
            self.prompt_tokens = len(prompt)
        for choice in getattr(output, "outputs", None) or ():
            self.completion_tokens += len(choice.token_ids)


current_meter: ContextVar[TokenMeter | None] = ContextVar("serve_app_token_meter", default=None)
