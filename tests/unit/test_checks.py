"""The model replica refuses, naming the field, what vLLM would fail on or leave unfinished."""

from __future__ import annotations

import pytest

from serve_app import errors
from serve_app.engine.checks import MAX_N, check_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def refused(body: dict) -> errors.InvalidRequest:
    with pytest.raises(errors.InvalidRequest) as info:
        check_request(body)
    return info.value


def test_a_plain_request_passes() -> None:
    check_request({**CHAT, "top_k": 40, "seed": 2**63 - 1, "structured_outputs": {"json": {}}})


@pytest.mark.parametrize("value", ["x", 1, [1], True])
def test_structured_outputs_must_be_an_object(value: object) -> None:
    assert refused({**CHAT, "structured_outputs": value}).param == "structured_outputs"


def test_integers_beyond_64_bits_anywhere_are_refused() -> None:
    assert refused({**CHAT, "top_k": 2**70}).param == "top_k"
    assert refused({**CHAT, "logit_bias": {"1": 2**70}}).param == "logit_bias"


@pytest.mark.parametrize("value", [2**31, 2**40, 1e21])
def test_top_k_beyond_32_bits_is_refused(value: float) -> None:
    assert refused({**CHAT, "top_k": value}).param == "top_k"


def test_lone_surrogate_in_stop_and_nan_are_refused() -> None:
    assert refused({**CHAT, "stop": ["ok", "\ud800"]}).param == "stop"
    assert refused({**CHAT, "temperature": float("nan")}).param == "temperature"


def test_n_is_bounded() -> None:
    check_request({**CHAT, "n": MAX_N})
    assert refused({**CHAT, "n": MAX_N + 1}).param == "n"


def test_deep_nesting_does_not_exhaust_the_stack() -> None:
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    check_request({**CHAT, "messages": deep})  # vLLM's validation refuses it; no RecursionError here


def test_an_answer_too_large_to_send_is_refused_before_the_work() -> None:
    big = {**CHAT, "n": 128, "max_tokens": 60000, "logprobs": True, "top_logprobs": 20}
    assert refused(big).param == "max_tokens"
    check_request({**big, "stream": True})  # a stream is never held whole
    check_request({**CHAT, "n": 3, "max_tokens": 1500, "logprobs": True, "top_logprobs": 20})


def test_every_endpoints_max_token_field_counts_toward_the_answer_size() -> None:
    # The Responses API bounds its answer with max_output_tokens: it cannot escape the cap.
    responses = {"model": "m", "input": "hi", "max_output_tokens": 20_000_000}
    err = refused(responses)
    assert err.status == 400 and err.param == "max_output_tokens"
    assert "lower max_output_tokens" in err.message
    check_request({**responses, "max_output_tokens": 1000})
    check_request({**responses, "stream": True})
    # Chat's two names: the larger one (vLLM reads max_completion_tokens first) is named.
    assert refused({**CHAT, "max_completion_tokens": 20_000_000}).param == "max_completion_tokens"


def _lora_refusal(request) -> errors.InvalidRequest | None:
    from serve_app.engine.checks import check_prepared
    try:
        check_prepared(request, lora=True)
    except errors.InvalidRequest as exc:
        return exc
    check_prepared(request, lora=False)  # without LoRA every one of these is the engine's to serve
    return None


def test_prompt_logprobs_are_refused_only_with_lora_on() -> None:
    """vLLM's engine dies on prompt log-probabilities with LoRA on (vllm#16668): the replica
    refuses each way of asking for them, in vLLM's own request models, and nothing else."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    asks = [ChatCompletionRequest(**chat, prompt_logprobs=0),
            ChatCompletionRequest(**chat, echo=True),  # top_logprobs 0 by default: asks
            ChatCompletionRequest(**chat, echo=True, logprobs=True, top_logprobs=2),
            CompletionRequest(model="m", prompt="hi", prompt_logprobs=1),
            CompletionRequest(model="m", prompt="hi", echo=True, logprobs=0)]
    for request in asks:
        refusal = _lora_refusal(request)
        assert refusal is not None, request
        assert refusal.param in ("prompt_logprobs", "echo") and "LoRA" in refusal.message
    assert _lora_refusal(ChatCompletionRequest(**chat, prompt_logprobs=1)).param == "prompt_logprobs"
    assert _lora_refusal(ChatCompletionRequest(**chat, echo=True)).param == "echo"
    fine = [ChatCompletionRequest(**chat), ChatCompletionRequest(**chat, logprobs=True, top_logprobs=3),
            CompletionRequest(model="m", prompt="hi", logprobs=2),
            CompletionRequest(model="m", prompt="hi", echo=True)]  # echo without logprobs
    for request in fine:
        assert _lora_refusal(request) is None, request
