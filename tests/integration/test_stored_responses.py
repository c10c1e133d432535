"""Stored Responses through the real stack (2 gateway replicas sharing Redis, real engines), driven
by the openai SDK: a chain of turns by previous_response_id across two model deployments and a
gateway replica's death, a background response replayed from starting_after, a cancel, and
another tenant's reads."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from loadtests.harness.faults import kill_and_replace

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def oai(stack) -> Iterator[openai.OpenAI]:
    # Retries: a request that meets the killed gateway replica is retried.
    with openai.OpenAI(base_url=stack.base_url, api_key=stack.keys["all"], max_retries=4) as c:
        yield c


def _kill_a_gateway_and_wait(stack) -> None:
    kill_and_replace(stack.proc.pid, "gateway")


def test_a_chain_of_turns_survives_other_models_and_a_gateway_death(stack, oai) -> None:
    r1 = oai.responses.create(model="tiny-chat", input="My name is Ada. Say hi.",
                              max_output_tokens=8)
    assert r1.id.startswith("resp_") and r1.store is True and r1.status in ("completed", "incomplete")
    # Turn 2 on the other model deployment: the chain is the gateway's, not an engine's memory.
    r2 = oai.responses.create(model="tiny-chat-b", input="What is my name?", max_output_tokens=8,
                              previous_response_id=r1.id)
    assert r2.previous_response_id == r1.id
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    _kill_a_gateway_and_wait(stack)
    r3 = oai.responses.create(model="tiny-chat", input="Say it again.", max_output_tokens=8,
                              previous_response_id=r2.id)
    assert r3.usage.input_tokens > r2.usage.input_tokens + r2.usage.output_tokens
    items = list(oai.responses.input_items.list(r3.id, order="asc"))
    texts = [c.text for it in items if it.type == "message" for c in it.content]
    assert texts[0] == "My name is Ada. Say hi." and texts[-1] == "Say it again."
    assert "What is my name?" in texts and len(texts) == 5  # 3 inputs + 2 earlier outputs
    assert oai.responses.retrieve(r2.id).output_text == r2.output_text
    oai.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r1.id)


def test_a_background_response_replays_from_starting_after(stack, oai) -> None:
    r = oai.responses.create(model="tiny-chat", input="Count from one to twenty.",
                             max_output_tokens=32, background=True)
    assert r.background is True and r.status in ("queued", "in_progress")
    deadline = time.monotonic() + 120
    while oai.responses.retrieve(r.id).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    done = oai.responses.retrieve(r.id)
    assert done.status in ("completed", "incomplete") and done.output_text
    _kill_a_gateway_and_wait(stack)  # the events are in the shared store, not in a replica
    every = [e.sequence_number for e in oai.responses.retrieve(r.id, stream=True)]
    assert every == list(range(len(every))) and len(every) > 5
    rest = [e.sequence_number
            for e in oai.responses.retrieve(r.id, stream=True, starting_after=3)]
    assert rest == every[4:]  # none lost, none repeated
    with pytest.raises(openai.BadRequestError):
        list(oai.responses.retrieve(r.id, stream=True, starting_after=len(every) + 5))


def test_cancel_a_background_response(stack, oai) -> None:
    r = oai.responses.create(model="tiny-chat", input="Write a very long story about the sea.",
                             max_output_tokens=4000, background=True,
                             extra_body={"ignore_eos": True})
    time.sleep(1.0)
    cancelled = oai.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    seen = len(list(oai.responses.retrieve(r.id, stream=True)))
    time.sleep(1.5)
    assert len(list(oai.responses.retrieve(r.id, stream=True))) == seen  # it stopped generating
    assert oai.responses.retrieve(r.id).status == "cancelled"


def test_another_tenants_response_is_unknown(stack, oai) -> None:
    r = oai.responses.create(model="tiny-chat", input="A secret: 42.", max_output_tokens=4)
    with openai.OpenAI(base_url=stack.base_url, api_key=stack.keys["fuzz-a"],
                       max_retries=0) as other:
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.input_items.list(r.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(r.id)
        with pytest.raises(openai.BadRequestError) as info:
            other.responses.create(model="tiny-chat", input="What was the secret?",
                                   previous_response_id=r.id, max_output_tokens=4)
    assert info.value.body["param"] == "previous_response_id"
    assert oai.responses.retrieve(r.id).id == r.id  # untouched for its own tenant
