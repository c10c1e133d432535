"""Checks of a request body in the model replica, before vLLM sees it.

Each refuses, with a 400 naming the field, an input that vLLM's request models let through and
something later fails on: a 500 with nothing logged, and for some (``top_k`` of 2**70, a lone
surrogate in ``stop``) a request that vLLM counts as unfinished forever, one engine slot less each
time. The gateway refuses most of these already while parsing (``gateway/body.py``); these checks
hold for any caller of the model deployment.
"""

from __future__ import annotations

from typing import Any

from serve_app import errors
from serve_app.protocol import MAX_TOKENS_FIELDS, json_offence, number_text

INT32_MAX = 2**31 - 1
MAX_N = 128  # OpenAI's own limit on choices per request
# A complete (non-streamed) answer is held whole in the model replica and in the gateway, and
# crosses between them in parts (protocol.split_complete). One that would be larger than this is
# refused before any work: stream it instead.
MAX_ANSWER_BYTES = 256 * 1024 * 1024
TOKEN_BYTES = 16  # JSON bytes a generated token adds to an answer, about
LOGPROB_BYTES = 128  # and each log-probability entry (token, logprob, bytes), about

# Fields that must be JSON objects when present (vLLM reads them as mappings).
OBJECT_FIELDS = ("structured_outputs", "stream_options", "chat_template_kwargs", "logit_bias",
                 "mm_processor_kwargs", "vllm_xargs")
# Fields vLLM passes on as C integers of 32 bits.
INT32_FIELDS = ("top_k", "n", "best_of", "min_tokens", *MAX_TOKENS_FIELDS, "logprobs",
                "top_logprobs", "prompt_logprobs", "truncate_prompt_tokens", "dimensions", "priority")


def check_request(body: dict[str, Any]) -> None:
    """Raise ``InvalidRequest`` (with ``param``) for what vLLM would fail on or leak."""
    for key, value in body.items():
        bad = json_offence(value)
        if bad:
            raise errors.InvalidRequest(f"{key}: {bad}", param=str(key))
    for name in OBJECT_FIELDS:
        value = body.get(name)
        if value is not None and not isinstance(value, dict):
            raise errors.InvalidRequest(
                f"{name} must be an object, not {type(value).__name__}", param=name)
    for name in INT32_FIELDS:
        value = body.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not -INT32_MAX - 1 <= value <= INT32_MAX:
            raise errors.InvalidRequest(f"{name} is out of range: {number_text(value)}", param=name)
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > MAX_N:
        raise errors.InvalidRequest(f"n must be at most {MAX_N}, not {n}", param="n")
    size = answer_bytes(body)
    if size > MAX_ANSWER_BYTES:
        field = _budget(body)[0]
        raise errors.InvalidRequest(
            f"the answer would be about {size // 2**20} MiB, over the limit of "
            f"{MAX_ANSWER_BYTES // 2**20} MiB for a complete answer: lower {field}, n or "
            "top_logprobs, or set stream: true", param=field)


def check_prepared(request: Any, *, lora: bool) -> None:
    """Refuse what the engine would crash on once vLLM has read the body into ``request``.

    With LoRA on (``engine.enable_lora``), vLLM's prompt log-probabilities use the step's sampling
    LoRA mapping for every prompt token (vllm-project/vllm#16668, #29955): the engine dies on an
    einsum shape error, every request on the replica with it, whichever model or adapter each
    named. ``prompt_logprobs`` is asked for outright, or by ``echo`` with (top_)logprobs, which
    chat sets to 0 by default."""
    if not lora:
        return
    asked = getattr(request, "prompt_logprobs", None)
    if asked is None and getattr(request, "echo", False):
        # chat: top_logprobs (0 by default); completions: logprobs (None by default)
        asked = getattr(request, "top_logprobs", getattr(request, "logprobs", None))
    if asked is not None:
        param = "prompt_logprobs" if getattr(request, "prompt_logprobs", None) is not None else "echo"
        raise errors.InvalidRequest(
            "prompt log-probabilities (prompt_logprobs, or echo with logprobs) are not available "
            "on a model that serves LoRA adapters: vLLM cannot compute them with LoRA on",
            param=param)


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _budget(body: dict[str, Any]) -> tuple[str, int]:
    """The largest completion bound the body sets, of any endpoint's fields, and its field
    (the first field and 0 when it sets none): the body's endpoint is not known here."""
    return max(((name, _int(body.get(name))) for name in MAX_TOKENS_FIELDS), key=lambda b: b[1])


def answer_bytes(body: dict[str, Any]) -> int:
    """An upper estimate of a complete answer's size from what the request asks for (0 for a
    stream, or when it names no token budget)."""
    if body.get("stream") is True:
        return 0
    tokens = _budget(body)[1]
    choices = max(_int(body.get("n"), 1), _int(body.get("best_of"), 1))
    logprobs = body.get("logprobs")
    per_token = TOKEN_BYTES
    if logprobs is True:  # chat: the token's own, plus top_logprobs alternatives
        per_token += LOGPROB_BYTES * (1 + _int(body.get("top_logprobs")))
    elif _int(logprobs):  # completions: logprobs is the number of alternatives
        per_token += LOGPROB_BYTES * (1 + _int(logprobs))
    return tokens * choices * per_token
