"""The request's pass (its books) through the real Pipeline, Admission, Forwarder and Usage (only
the model deployment is fake): every ending exits the pass once, with the engine's token counts."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from serve_app import errors
from serve_app.config import AppConfig, KeyRecord
from serve_app.gateway.accounting.timing import StageClock
from serve_app.gateway.accounting.tracecontext import TraceContext
from serve_app.gateway.accounting.usage import Usage
from serve_app.gateway.admission.admission import Admission
from serve_app.gateway.admission.ledger import Outcome, Pass
from serve_app.gateway.forward import Forwarder
from serve_app.gateway.http.answers import to_response
from serve_app.gateway.pipeline import Pipeline
from serve_app.gateway.routing import affinity
from serve_app.gateway.routing.router import Router
from serve_app.protocol import ENDPOINTS, head, split_complete, tokens_of, trailer
from serve_app.state.limits import MemoryBackend
from serve_app.state.usage import MemoryUsageStore
from tests.unit.fakes import HANG, FakeClient, FakeStream
from tests.unit.test_forward import _serve

TPM = 100_000
NOW = 1_000_000.0
KEY = KeyRecord(id="k", digest="sha256:" + "0" * 64, tier="standard")
CHAT = ENDPOINTS["chat"]


def _cfg() -> AppConfig:
    return AppConfig.model_validate({
        "tiers": {"standard": {"priority": 5, "key_limits": {"tpm": TPM, "max_concurrent": 4}}},
        "default_tier": "standard",
        "models": [
            {"id": "tiny", "source": "builtin:tiny-chat", "fallback": "spare",
             "adapters": [{"name": "tiny-pirate", "source": "builtin:tiny-chat-pirate"}],
             "engine": {"enable_lora": True}},
            {"id": "spare", "source": "builtin:tiny-chat"},
        ],
    })


class Env:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, gens: dict[str, FakeStream]) -> None:
        monkeypatch.setattr("serve_app.gateway.admission.admission.clock", lambda: NOW)  # no refill
        cfg = _cfg()
        self.handles = {m: FakeClient(g) for m, g in gens.items()}
        self.store = MemoryUsageStore()
        self.backend = MemoryBackend()
        usage = Usage(self.store, None)
        self.admission = Admission(cfg, self.backend, usage=usage)
        clients = dict(self.handles)
        self.pipeline = Pipeline(cfg, Router(cfg), self.admission,
                                 Forwarder(clients, cfg.gateway.http), usage)

    async def request(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
        return to_response(await self.pipeline.handle(KEY, CHAT, body, 40, StageClock(time.time()),
                                                      TraceContext.from_headers({}), headers))

    async def tpm_charged(self) -> int:
        """Tokens the key's TPM bucket holds charged now (GCRA: each token moves the bucket's
        theoretical arrival time by 60/TPM s; the clock is frozen, so nothing refills)."""
        tat = self.backend._tat.get(f"key:{KEY.id}:tpm", NOW)
        return round((max(tat, NOW) - NOW) * TPM / 60)

    def key_slots(self) -> float:
        """The key's concurrency slots taken now."""
        return self.backend._gauge.get(f"key:{KEY.id}:conc", 0.0)

    async def totals(self) -> dict[str, int]:
        return await self.store.get(KEY.id)


BODY = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 2000,
        "stream": True}


def test_cut_short_stream_charges_the_engines_tokens_to_usage_and_tpm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three paced events carried 25 tokens: both the usage totals and the TPM bucket are charged
    the engine's 25 (plus the prompt's 17), where the old estimate charged about one per event."""
    gen = FakeStream([head(200, b"data: a\n\n", stream=True, tokens=tokens_of(17, 1)),
                   (b"data: b\n\n", 12), (b"data: c\n\n", 25), HANG])
    env = Env(monkeypatch, {"tiny": gen, "spare": FakeStream([])})

    async def scenario() -> tuple[int, dict[str, int]]:
        await _serve(await env.request(dict(BODY)), disconnect_after=3)  # then the client goes
        return await env.tpm_charged(), await env.totals()

    charged, totals = asyncio.run(scenario())
    assert gen.cancelled
    assert totals["prompt_tokens"] == 17 and totals["completion_tokens"] == 25
    assert charged == 17 + 25


def test_finished_stream_charges_the_trailer(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = FakeStream([head(200, b"data: a\n\n", stream=True, tokens=tokens_of(9, 1)),
                   (b"data: b\n\n", 4), trailer(9, 5)])
    env = Env(monkeypatch, {"tiny": gen, "spare": FakeStream([])})

    async def scenario() -> tuple[int, dict[str, int]]:
        await _serve(await env.request(dict(BODY)))
        return await env.tpm_charged(), await env.totals()

    charged, totals = asyncio.run(scenario())
    assert (totals["prompt_tokens"], totals["completion_tokens"], charged) == (9, 5, 14)


def test_a_client_gone_before_the_first_chunk_frees_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The response's receive answers http.disconnect before the first body chunk: Starlette
    never starts the body iterator, yet the request leaves no trace in flight."""
    gen = FakeStream([head(200, b"data: a\n\n", stream=True, tokens=tokens_of(6, 0)), HANG])
    env = Env(monkeypatch, {"tiny": gen, "spare": FakeStream([])})

    async def scenario() -> dict[str, int]:
        resp = await env.request(dict(BODY))
        assert env.admission.inflight["tiny"] == 1 and env.key_slots() == 1
        assert await _serve(resp, disconnect_after=0) == []
        return await env.totals()

    totals = asyncio.run(scenario())
    assert env.admission.inflight["tiny"] == 0
    assert env.key_slots() == 0  # the key's concurrency slot is released
    assert gen.cancelled  # and the engine's request cancelled
    assert totals["requests"] == 1 and totals["prompt_tokens"] == 6


def test_a_break_between_parts_is_neither_rerun_nor_backpressure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The model ran and its complete answer broke after the head: no fallback re-runs it, and it
    is booked as a failure (502) with the reservation kept, never as a backpressure rejection."""
    items = split_complete(200, b"x" * 10000, None, part_bytes=4096)
    broken = FakeStream([items[0], items[1], RuntimeError("replica died")])
    spare = FakeStream([head(200, b"{}", tokens=tokens_of(3, 4))])
    env = Env(monkeypatch, {"tiny": broken, "spare": spare})

    async def scenario() -> tuple[int, dict[str, int]]:
        with pytest.raises(errors.AnswerBroken):
            await env.request({**BODY, "stream": False})
        return await env.tpm_charged(), await env.totals()

    charged, totals = asyncio.run(scenario())
    assert env.handles["spare"].calls == []
    assert not any(k.startswith("rejected_") for k in totals)
    assert totals["requests"] == 1 and totals["status_502"] == 1
    assert charged > 0  # tokens unknown: the reservation stays charged
    assert env.admission.inflight["tiny"] == 0 and env.admission.inflight["spare"] == 0
    assert env.key_slots() == 0


def test_unavailable_model_falls_back_once_and_closes_once(monkeypatch: pytest.MonkeyPatch) -> None:
    full = FakeStream([ConnectionRefusedError()])
    spare = FakeStream([head(200, b"{}", tokens=tokens_of(3, 4))])
    env = Env(monkeypatch, {"tiny": full, "spare": spare})
    body = {**BODY, "stream": False}

    async def scenario() -> tuple[Any, int, dict[str, int]]:
        resp = await env.request(body)
        return resp, await env.tpm_charged(), await env.totals()

    resp, charged, totals = asyncio.run(scenario())
    assert resp.headers["x-served-by"] == "spare"
    assert [c.endpoint for c in env.handles["spare"].calls] == ["chat"]
    assert totals["requests"] == 1 and charged == 7
    assert env.admission.inflight == {"tiny": 0, "spare": 0}


def test_no_answer_anywhere_is_one_rejection_and_refunds_the_reservation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = Env(monkeypatch, {
        "tiny": FakeStream([ConnectionRefusedError()]),
        "spare": FakeStream([ConnectionRefusedError()]),
    })

    async def scenario() -> tuple[int, dict[str, int]]:
        with pytest.raises(errors.ServiceUnavailable):
            await env.request({**BODY, "stream": False})
        return await env.tpm_charged(), await env.totals()

    charged, totals = asyncio.run(scenario())
    assert totals == {"requests": 1, "rejected_backpressure": 1}
    assert charged == 0
    assert env.admission.inflight == {"tiny": 0, "spare": 0}


def test_a_second_exit_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    env = Env(monkeypatch, {"tiny": FakeStream([]), "spare": FakeStream([])})

    async def scenario() -> dict[str, int]:
        ticket = await env.admission.admit(KEY, ["tiny"], {"max_tokens": 10}, 0)
        admitted = Pass(KEY, env.admission.tier(KEY), ticket, env.admission, env.pipeline.usage,
                        None, StageClock(time.time()), TraceContext.from_headers({}))
        await admitted.exit(Outcome(200, tokens_of(1, 2)))
        await admitted.exit(Outcome(200, tokens_of(100, 200)))
        return await env.totals()

    assert asyncio.run(scenario())["completion_tokens"] == 2


def test_an_adapters_requests_share_its_affinity_key_and_its_books(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every session of an adapter is keyed by the adapter (its home replica holds it loaded), a
    base model's sessions keep their own keys, and the adapter's usage is its own."""
    def answer() -> FakeStream:
        return FakeStream([head(200, b'{"ok": 1}', tokens=tokens_of(3, 2))])

    env = Env(monkeypatch, {"tiny": answer, "spare": FakeStream([])})  # type: ignore[dict-item]
    plain = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 2}

    async def scenario() -> None:
        for model in ("tiny-pirate", "tiny"):
            for session in ("s1", "s2"):
                await _serve(await env.request({**plain, "model": model}, {"session_id": session}))

    asyncio.run(scenario())
    calls = env.handles["tiny"].calls
    keys = [c.ctx["affinity"] for c in calls]
    assert [c.body["model"] for c in calls] == ["tiny-pirate"] * 2 + ["tiny"] * 2
    assert keys[0] == keys[1] == affinity.adapter_affinity("tiny-pirate")
    assert len({keys[1], keys[2], keys[3]}) == 3  # the base model's two sessions: two keys
    totals = asyncio.run(env.totals())
    assert totals["m:tiny-pirate:requests"] == 2 and totals["m:tiny:requests"] == 2
